#!/usr/bin/env bash
# The statistics ledger on the H200: the GPU suite in both modes, and cucache-bench's
# stats_many_pools cases (simulated device; the host's figures).
set -u
cat .gpu/COMMIT
bash tools/gpu_suite.sh .gpu/build/bin "$OUT/suite" > /dev/null 2>&1
cat "$OUT/suite/summary.txt"
(cd .gpu/build/bin && ./cucache-bench --benchmark_filter='stats_many_pools' 2>&1 | tail -4) | tee "$OUT/stats_bench.txt"
cd "$OUT" && tar czf results.tgz suite && rm -rf suite
