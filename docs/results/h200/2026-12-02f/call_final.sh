#!/usr/bin/env bash
# The merged tree on the H200: the GPU suite (both modes) and the seven traces' replay against
# c10 in expandable mode, three rounds (tools/gpu_expandable.sh).
set -u
cat .gpu/COMMIT
bash tools/gpu_suite.sh .gpu/build/bin "$OUT/suite" > /dev/null 2>&1
cat "$OUT/suite/summary.txt"
grep -h "live streams" "$OUT/suite/streams_gpu_test.log"
bash tools/build_c10_peer.sh .gpu/build/bin > "$OUT/c10_build.log" 2>&1 || echo "c10 peer build failed"
ROUNDS=3 bash tools/gpu_expandable.sh .gpu/build/bin "$OUT/replay" replay > /dev/null 2>&1
echo "replay exit $?"
cat "$OUT/replay/summary.txt"
cd "$OUT" && tar czf results.tgz suite replay c10_build.log && rm -rf suite replay
