#!/usr/bin/env bash
# The H200 run of issue 21 (the fast path without its stream-query tax), in one call of the device
# tool, about 3-4 minutes:
#   1. stream_query: each candidate stream query alone (runtime wrappers, driver entry points,
#      cucache's backend calls), 1, 8 and 16 threads -- which calls the hot path should make;
#   2. the pair, churn and threads tables of cucache (both modes, GPU and simulated device) against
#      c10 and cudaMallocAsync, in one cucache-bench run (pair.md: the pair on a created stream and
#      on the legacy default stream, which cucache asks the driver nothing about; churn.md;
#      threads.md with the one-stream case);
#   3. cucache-fastpath: the simulated device's pair on this host, both modes (the allocator's own
#      host cost, no stream query), and under callgrind where valgrind is installed;
#   4. the safety tests: graph_capture_gpu_test and cuda_backend_gpu_test on the GPU,
#      graph_capture_test, dead_stream_test and stream_reuse_test on the simulated device.
#
#   tools/fastpath_gpu.sh BIN_DIR OUT_DIR
#
# BIN_DIR holds cucache-bench (with its libbenchmark), cucache-fastpath and the five test
# binaries, built elsewhere with the static cudart (docs/benchmarks.md, "Host time: cache hits, threads, churn"), and
# libcucache_c10_peer.so if it was built; without it, tools/build_c10_peer.sh builds it into
# BIN_DIR first (needs torch). BIN_DIR/COMMIT, if present, names the commit the binaries were
# built from. Writes one log per step and summary.txt into OUT_DIR; exit status 0 only if every
# step exited 0.
set -uo pipefail
bin=${1:?bin dir}; out=${2:?out dir}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$out"
source "$repo/tools/gpu_run.sh"
{
  gpu_line
  echo "commit: $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc)"
} | tee "$out/machine.txt"

# c10, the peer (PyTorch's caching allocator), when it can be built here.
if [[ ! -f $bin/libcucache_c10_peer.so ]]; then
  run build_c10_peer 120 bash "$repo/tools/build_c10_peer.sh" "$bin"
fi

# 1. Each stream query alone.
run stream_query 120 "$bin/cucache-bench" '--benchmark_filter=^stream_query(_one_stream)?/' \
  --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true \
  --benchmark_format=json "--benchmark_out=$out/stream_query.json"
python3 - "$out/stream_query.json" > "$out/stream_query.md" <<'EOF'
import json, sys
rows = {}
try:
    benchmarks = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no stream_query results ({e}): no GPU?")
for b in benchmarks:
    if b.get("aggregate_name") != "median":
        continue
    name, threads = b["run_name"].split("/real_time")[0], b.get("threads", 1)
    one = name.startswith("stream_query_one_stream/")
    call = name.split("/", 1)[1]
    rows.setdefault(call, {})["one" if one else threads] = b.get("ns_per_query", float("nan"))
print("| call | ns, 1 thread | ns, 8 threads | ns, 16 threads | ns, 8 threads on one stream |")
print("| --- | --- | --- | --- | --- |")
for call, t in rows.items():
    print(f"| {call} | " +
          " | ".join(f"{t.get(n, float('nan')):.1f}" for n in (1, 8, 16, "one")) + " |")
EOF
cat "$out/stream_query.md"

# 2. Pairs, churn and threads, cucache against its peers, one run.
run bench 240 "$bin/cucache-bench" \
  '--benchmark_filter=^(pair|pair_legacy|churn_small|churn_large|threads|threads_one_stream)/(cucache_cuda|cucache_cuda_expandable|cucache_cuda_announced|cucache_cuda_expandable_announced|cucache_sim|cucache_sim_expandable|c10|cudaMallocAsync)(/|$)' \
  --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true \
  --benchmark_report_aggregates_only=true --benchmark_format=json "--benchmark_out=$out/bench.json"
# Pairs by size, on a created stream and on the legacy default stream; churn. (The report script
# this step called, tools/bench_report.py, is gone: tools/charts.py draws docs/benchmarks.md's
# charts from docs/data/charts.)
python3 - "$out/bench.json" "$out/churn.md" > "$out/pair.md" <<'EOF'
import json, sys
try:
    benchmarks = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no bench results ({e})")
pairs, churn, sizes = {}, {}, []
for b in benchmarks:
    if b.get("aggregate_name") != "median":
        continue
    parts = b["run_name"].split("/")
    if parts[0] in ("pair", "pair_legacy"):
        if parts[2] not in sizes:
            sizes.append(parts[2])
        pairs.setdefault(parts[1], {})[(parts[0], parts[2])] = b.get("ns_per_pair", float("nan"))
    elif parts[0] in ("churn_small", "churn_large"):
        churn.setdefault(parts[1], {})[parts[0]] = b.get("ns_per_op", float("nan"))
nan = float("nan")
print("ns per cache-hit pair, median of the repetitions; each cell: created stream / legacy "
      "default stream (nullptr)\n")
print("| allocator | " + " | ".join(sizes) + " |")
print("| --- |" + " --- |" * len(sizes))
for alloc, r in pairs.items():
    cells = [f"{r.get(('pair', s), nan):.1f} / {r.get(('pair_legacy', s), nan):.1f}" for s in sizes]
    print(f"| {alloc} | " + " | ".join(cells) + " |")
with open(sys.argv[2], "w") as f:
    f.write("ns per churn operation (free one random live block, allocate another), median\n\n")
    f.write("| allocator | churn_small | churn_large |\n| --- | --- | --- |\n")
    for alloc, r in churn.items():
        f.write(f"| {alloc} | {r.get('churn_small', nan):.1f} | {r.get('churn_large', nan):.1f} |\n")
EOF
cat "$out/pair.md" "$out/churn.md"
# Threads, a stream per thread and one shared stream.
python3 - "$out/bench.json" > "$out/threads.md" <<'EOF'
import json, sys
try:
    benchmarks = json.load(open(sys.argv[1]))["benchmarks"]
except (OSError, ValueError, KeyError) as e:
    sys.exit(f"no bench results ({e})")
rows = {}
for b in benchmarks:
    name = b["run_name"]
    if b.get("aggregate_name") != "median" or not name.startswith("threads"):
        continue
    case, alloc = name.split("/")[:2]
    rows.setdefault(alloc, {})[(case, b.get("threads", 1))] = b.get("ns_per_pair", float("nan"))
counts = (1, 2, 4, 8, 16)
print("Aggregate ns per pair (wall time / pairs), median of the repetitions:\n")
print("| allocator | " + " | ".join(str(t) for t in counts) +
      " | one stream: " + " | ".join(str(t) for t in counts) + " |")
print("| --- |" + " --- |" * (2 * len(counts)))
for alloc, r in rows.items():
    cells = [r.get(("threads", t), float("nan")) for t in counts]
    cells += [r.get(("threads_one_stream", t), float("nan")) for t in counts]
    print(f"| {alloc} | " + " | ".join(f"{v:.1f}" for v in cells) + " |")
EOF
cat "$out/threads.md"

# 3. The allocator's own host cost: the simulated device's pair, no stream query.
for mode in "" --expandable; do
  for size in 512 65536 8388608 67108864 536870912; do
    echo "${mode:-default} $size: $("$bin/cucache-fastpath" $mode pair "$size" 2000000)"
  done
done | tee "$out/fastpath_sim.txt"
if command -v valgrind > /dev/null; then
  for mode in "" --expandable; do
    valgrind --tool=callgrind --toggle-collect='*measured_loop*' \
      --callgrind-out-file="$out/callgrind${mode}.out" "$bin/cucache-fastpath" $mode pair 65536 20000 \
      > /dev/null 2>&1
  done
fi

# 4. Safety: captures detected, dead streams' blocks never handed to a new stream.
run graph_capture_gpu_test 120 "$bin/graph_capture_gpu_test"
run cuda_backend_gpu_test 60 "$bin/cuda_backend_gpu_test"
for t in graph_capture_test dead_stream_test stream_reuse_test; do
  run "$t" 60 "$bin/$t"
done
exit $status
