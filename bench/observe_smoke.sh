#!/usr/bin/env bash
# ctest bench_observe_smoke: every observe case of cucache-bench and the bare pair it is compared
# with run to their end, none skipped with an error. Figures only: nothing is asserted about time.
#   bench/observe_smoke.sh PATH/TO/cucache-bench
set -uo pipefail
out=$("$1" '--benchmark_filter=^(observe/|pair/cucache_sim/64KiB)' --benchmark_min_time=0.01 2>&1)
status=$?
echo "$out"
[[ $status -eq 0 ]] || { echo "observe_smoke: cucache-bench exited $status"; exit 1; }
if grep -q "ERROR OCCURRED" <<<"$out"; then echo "observe_smoke: a case failed"; exit 1; fi
for name in observe/global_sim/off observe/global_sim/tag_popped observe/global_sim/tagged \
            observe/global_sim/backtraces pair/cucache_sim/64KiB; do
  grep -q "^$name.*ns_per_pair=" <<<"$out" || { echo "observe_smoke: $name did not run"; exit 1; }
done
