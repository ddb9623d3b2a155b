#!/usr/bin/env bash
# ctest bench_*_smoke: the cucache-bench cases a filter selects run to their end, none skipped
# with an error, and each named case reports the named counter. Figures only: nothing is asserted
# about time.
#   bench/smoke.sh PATH/TO/cucache-bench FILTER COUNTER CASE...
set -uo pipefail
bench=$1 filter=$2 counter=$3
shift 3
out=$("$bench" "--benchmark_filter=$filter" --benchmark_min_time=0.01 2>&1)
status=$?
echo "$out"
[[ $status -eq 0 ]] || { echo "smoke: cucache-bench exited $status"; exit 1; }
if grep -q "ERROR OCCURRED" <<<"$out"; then echo "smoke: a case failed"; exit 1; fi
for name in "$@"; do
  grep -q "^$name[ /].*$counter=" <<<"$out" || { echo "smoke: $name did not report $counter"; exit 1; }
done
