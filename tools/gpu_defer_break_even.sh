#!/usr/bin/env bash
# The host-time break-even of defer_coalescing on a GPU host (decision 0033): each synthetic trace
# of tools/defer_break_even_traces.py replayed with the key off and on, adjacently in random
# order, in both modes, pinned to one CPU, ROUNDS rounds (default 10); then per trace and mode the
# median and interquartile range of the rounds' on/off ratios of host ns per op, cold pass and
# warm pass (`--warm --repeat 3`: each the median of three timed replays).
#   tools/gpu_defer_break_even.sh BIN_DIR TRACE_DIR
set -euo pipefail
bin=${1:?BIN_DIR (cucache-replay)}; traces=${2:?TRACE_DIR (tools/defer_break_even_traces.py)}
cpu=${CPU:-5}
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for ((r = 1; r <= ${ROUNDS:-10}; r++)); do
  for t in "$traces"/p*.csv.gz; do
    for mode in default expandable; do
      for v in $(printf 'off\non\n' | shuf); do
        conf=""
        [[ $mode == expandable ]] && conf=expandable_segments:True
        [[ $v == on ]] && conf=${conf:+$conf,}defer_coalescing:True
        taskset -c "$cpu" "$bin/cucache-replay" --backend cuda --peers none --json --warm --repeat 3 \
          ${conf:+--config "$conf"} "$t" 2> /dev/null |
          python3 -c 'import json, sys; d = json.loads(sys.stdin.readline()); print(sys.argv[1], d["stats"]["take_back_count"] / d["allocations"], d["host_ns_per_op"], d["warm"]["host_ns_per_op"])' \
            "$(basename "$t" .csv.gz) $mode $v $r" >> "$tmp"
      done
    done
  done
done
python3 - "$tmp" <<'PY'
import collections, statistics, sys
runs = collections.defaultdict(dict)
share = {}
for line in open(sys.argv[1]):
    t, mode, v, r, sh, cold, warm = line.split()
    runs[(t, mode, r)][v] = (float(cold), float(warm))
    if v == "on":
        share[(t, mode)] = float(sh)
print("%-6s %-10s %6s  %-28s %-28s" % ("trace", "mode", "share", "cold on/off [IQR]", "warm on/off [IQR]"))
for mode in ("default", "expandable"):
    for t in sorted({k[0] for k in runs}):
        cells = []
        for i in (0, 1):
            x = sorted(v["on"][i] / v["off"][i] for (tt, m, _), v in runs.items()
                       if tt == t and m == mode and len(v) == 2)
            q = len(x) // 4
            cells.append("%.3f [%.2f-%.2f]" % (statistics.median(x), x[q], x[-q - 1]))
        print("%-6s %-10s %5.1f%%  %-28s %-28s" % (t, mode, 100 * share[(t, mode)], *cells))
PY
