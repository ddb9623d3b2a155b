#!/usr/bin/env bash
# The cache-hit pair cases of two builds of cucache-bench, alternating in one call (the order
# drawn at random each round), pinned to one CPU: for a change to the allocation path, its effect
# beside the run-to-run spread of the machine. Prints, per case, the median and range of the
# rounds' medians for each build and new over old.
#   tools/gpu_pair_ab.sh OLD_BIN_DIR NEW_BIN_DIR
# Each BIN_DIR holds cucache-bench and libbenchmark beside it (tools/gpu_stage.sh). Environment:
# ROUNDS (default 6), CPU (default 5), FILTER (cucache-bench's --benchmark_filter; default the
# pair and pair_legacy cases of cucache's four settings at 512 B, 64 KiB and 1 MiB). A case that
# only one build has (a setting added since) is printed with that build's figures alone.
set -euo pipefail
old=${1:?OLD_BIN_DIR}; new=${2:?NEW_BIN_DIR}
rounds=${ROUNDS:-6}; cpu=${CPU:-5}
filter=${FILTER:-'^(pair|pair_legacy)/(cucache_cuda|cucache_cuda_expandable|cucache_cuda_announced|cucache_cuda_expandable_announced)/(512B|64KiB|1MiB)$'}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for ((r = 1; r <= rounds; r++)); do
  for v in $(printf 'old\nnew\n' | shuf); do
    dir=$old; [[ $v == new ]] && dir=$new
    LD_LIBRARY_PATH=$dir taskset -c "$cpu" "$dir/cucache-bench" "--benchmark_filter=$filter" \
      --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
      --benchmark_format=json "--benchmark_out=$tmp/${v}_$r.json" > /dev/null
  done
done
python3 - "$tmp" <<'PY'
import collections, glob, json, os, statistics, sys
d = collections.defaultdict(list)
for f in glob.glob(os.path.join(sys.argv[1], "*.json")):
    v = os.path.basename(f).split("_")[0]
    for b in json.load(open(f))["benchmarks"]:
        if b.get("aggregate_name") == "median":
            d[(b["run_name"], v)].append(b["real_time"])
for name in sorted({k[0] for k in d}):
    o, n = d[(name, "old")], d[(name, "new")]
    fig = lambda x: "%6.1f [%.0f-%.0f]" % (statistics.median(x), min(x), max(x))
    if o and n:
        print("%-52s old %s  new %s  new/old %.2f" % (
            name, fig(o), fig(n), statistics.median(n) / statistics.median(o)))
    else:
        print("%-52s %s %s  (only this build has it)" % (name, "old" if o else "new", fig(o or n)))
PY
