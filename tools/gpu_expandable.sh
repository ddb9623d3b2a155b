#!/usr/bin/env bash
# Issue 20's H200 figures for expandable segments, cucache against PyTorch's expandable mode, each
# part sized for one 10-minute call of the device tool (about 3 and 6 minutes):
#   tools/gpu_expandable.sh BIN_DIR OUT_DIR replay  -- the seven bundled traces, cold and warm
#       (--warm), cucache expandable_segments:True beside c10 in its expandable mode (--peers c10
#       runs c10 under the same PYTORCH_CUDA_ALLOC_CONF), ROUNDS (default 3) interleaved rounds,
#       one JSON line per trace per round in replay_ROUND.jsonl
#   tools/gpu_expandable.sh BIN_DIR OUT_DIR torch   -- bench/torch workloads (WORKLOADS, default
#       gpt2_train,resnet50_train,gpt2_train_dynseq) in expandable mode, PyTorch's allocator and
#       cucache's plug-in in turn, ROUNDS interleaved rounds, results.jsonl and table.md per round
# CONF (replay part): cucache's --config, default expandable_segments:True (e.g.
# CONF=expandable_segments:True,coarse_handles:8; c10 gets only the keys PyTorch shares). CONFS:
# several, separated by spaces, each round running every one in turn (interleaved); a summary
# table per configuration, the c10 columns from the runs beside it.
# BIN_DIR holds cucache-replay and libcucache_c10_peer.so (tools/build_c10_peer.sh BIN_DIR); the
# torch part needs the Python plug-in importable (docs/torch.md). Writes gpu.txt, one log per run
# and summary.txt (medians and spreads) into OUT_DIR; exit status 0 only if every run exited 0.
set -uo pipefail
bin=${1:?bin dir}; out=${2:?out dir}; part=${3:?replay or torch}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${ROUNDS:-3}
case $part in replay|torch) ;; *)
  echo "gpu_expandable.sh: unknown part '$part' (replay, torch)" >&2; exit 2 ;;
esac
mkdir -p "$out"
source "$repo/tools/gpu_run.sh"
gpu_line | tee "$out/gpu.txt"
git -C "$repo" rev-parse HEAD >> "$out/gpu.txt" 2>/dev/null
traces=("$repo"/traces/*.csv.gz)
case $part in
  replay)
    # Each round replays every trace through cucache and then c10 (the replay's order), so the two
    # allocators alternate over the rounds rather than running all of one first.
    read -ra confs <<< "${CONFS:-${CONF:-expandable_segments:True}}"
    for ((i = 1; i <= rounds; i++)); do
      for k in "${!confs[@]}"; do
        run "replay_${k}_$i" 150 "$bin/cucache-replay" --backend cuda --json --warm \
          --config "${confs[$k]}" --peers c10 "${traces[@]}"
        cp "$out/replay_${k}_$i.log" "$out/replay_${k}_$i.jsonl"
      done
    done
    for k in "${!confs[@]}"; do
    echo "== CUCACHE_CONF=${confs[$k]}" | tee -a "$out/summary.txt"
    python3 - "$out" "$rounds" "$k" <<'EOF' | tee -a "$out/summary.txt"
import json, statistics, sys
out, rounds, k = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {}
for i in range(1, rounds + 1):
    try:
        lines = [json.loads(l) for l in open(f"{out}/replay_{k}_{i}.jsonl") if l.startswith("{")]
    except OSError:
        continue
    for d in lines:
        runs.setdefault(d["trace"], []).append(d)
def spread(xs):
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"
print("trace | cucache cold ns/op | c10 cold ns/op | cold ratio | cucache warm | c10 warm | warm ratio"
      " | warm VM calls/1k ev | warm syncs/1k ev | peak resv cucache/c10")
for t, ds in sorted(runs.items()):
    c = [d["host_ns_per_op"] for d in ds]
    w = [d["warm"]["host_ns_per_op"] for d in ds]
    pc = [d["peers"]["c10"]["host_ns_per_op"] for d in ds if "c10" in d["peers"]]
    pw = [d["peers"]["c10"]["warm"]["host_ns_per_op"] for d in ds if "c10" in d["peers"]]
    ev = ds[0]["events"]
    wv = ds[0]["warm"]["vm_calls"]["total"] * 1000 / ev
    ws = ds[0]["warm"]["device_synchronizations"] * 1000 / ev
    pr = ds[0]["peers"].get("c10", {}).get("cucache_over_peer_reserved", 0)
    r = lambda a, b: statistics.median(a) / statistics.median(b) if a and b else float("nan")
    print(f"{t} | {spread(c)} | {spread(pc) if pc else '-'} | {r(c, pc):.2f} | {spread(w)} | "
          f"{spread(pw) if pw else '-'} | {r(w, pw):.2f} | {wv:.2f} | {ws:.3f} | {pr:.3f}")
# Where the cold pass's VM time goes (the H200 cost model of cucache-replay, first round): calls
# per 1,000 events and modelled ms by kind, cold and warm.
print("\ntrace | cold VM calls/1k ev | cold model ms: create | map | set_access | unmap | release | "
      "mem_get_info | total | warm model ms")
for t, ds in sorted(runs.items()):
    d = ds[0]
    m, ev = d["vm_model_us"], d["events"]
    print(f"{t} | {d['vm_calls']['total'] * 1000 / ev:.1f} | " +
          " | ".join(f"{m[k] / 1000:.1f}" for k in
                     ("create", "map", "set_access", "unmap", "release", "mem_get_info", "total")) +
          f" | {d['warm']['vm_model_us']['total'] / 1000:.2f}")
EOF
    done
    ;;
  torch)
    workloads=${WORKLOADS:-gpt2_train,resnet50_train,gpt2_train_dynseq}
    for ((i = 1; i <= rounds; i++)); do
      IFS=, read -ra ws <<< "$workloads"
      for w in "${ws[@]}"; do  # per workload: PyTorch, then cucache (run_workloads.py's order)
        run "torch_${w}_$i" 170 python3 "$repo/bench/torch/run_workloads.py" --workloads "$w" \
          --modes expandable --out "$out/torch_$i"
      done
    done
    python3 - "$out" "$rounds" <<'EOF' | tee -a "$out/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
steps = {}
peaks = {}
for i in range(1, rounds + 1):
    try:
        lines = [json.loads(l) for l in open(f"{out}/torch_{i}/results.jsonl")]
    except OSError:
        continue
    for d in lines:
        steps.setdefault((d["workload"], d["allocator"]), []).append(d["median_step_ms"])
        peaks.setdefault((d["workload"], d["allocator"]), []).append(d["peak_reserved"])
print("workload | cucache step ms (runs) | PyTorch step ms (runs) | ratio of medians | peak resv ratio")
for w in sorted({k[0] for k in steps}):
    c, t = steps.get((w, "cucache"), []), steps.get((w, "torch"), [])
    if not c or not t:
        continue
    pr = statistics.median(peaks[(w, "cucache")]) / statistics.median(peaks[(w, "torch")])
    print(f"{w} | {', '.join(f'{x:.1f}' for x in c)} | {', '.join(f'{x:.1f}' for x in t)} | "
          f"{statistics.median(c) / statistics.median(t):.3f} | {pr:.3f}")
EOF
    ;;
esac
exit $status
