#!/usr/bin/env bash
# Issue 22 on the H200: the GPU suite (both modes; streams_gpu_test has the 3,000 live-streams
# test), then 10,000 live streams in expandable mode.
set -u
cat .gpu/COMMIT
bash tools/gpu_suite.sh .gpu/build/bin "$OUT/suite"
CUCACHE_GPU_LIVE_STREAMS=10000 .gpu/build/bin/streams_gpu_test \
  --gtest_filter='*ThreeThousandLiveStreams*/1' > "$OUT/live10000_expandable.log" 2>&1
echo "live10000 exit $?"
tail -5 "$OUT/live10000_expandable.log"
cat "$OUT/suite/summary.txt"
grep -h "live streams" "$OUT/suite/streams_gpu_test.log"
