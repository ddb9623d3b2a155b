#!/usr/bin/env bash
# Issue 20's H200 figures for expandable segments, cucache against PyTorch's expandable mode, each
# part sized for one 10-minute call of the device tool (about 3 and 6 minutes):
#   tools/gpu_expandable.sh BIN_DIR OUT_DIR replay  -- the seven bundled traces, cold and warm
#       (--warm), cucache expandable_segments:True beside c10 in its expandable mode (--peers c10
#       runs c10 under the same PYTORCH_CUDA_ALLOC_CONF), ROUNDS (default 3) interleaved rounds,
#       one JSON line per trace per round in replay_ROUND.jsonl
#   tools/gpu_expandable.sh BIN_DIR OUT_DIR torch   -- bench/torch workloads (WORKLOADS, default
#       gpt2_train,resnet50_train,gpt2_train_dynseq) in expandable mode, PyTorch's allocator and
#       cucache's plug-in in turn (TORCH_RUNS: other modes and allocators), ROUNDS interleaved
#       rounds, results.jsonl per round; the summary gives steady steps and first cycles
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
    # TORCH_RUNS: the runs of a round per workload, in order, each MODE:ALLOCATORS of
    # run_workloads.py (e.g. "expandable:torch,cucache expandable_fine:cucache").
    read -ra truns <<< "${TORCH_RUNS:-expandable:torch,cucache}"
    for ((i = 1; i <= rounds; i++)); do
      IFS=, read -ra ws <<< "$workloads"
      for w in "${ws[@]}"; do
        for tr in "${truns[@]}"; do
          run "torch_${w}_${tr%%:*}_$i" 170 python3 "$repo/bench/torch/run_workloads.py" \
            --workloads "$w" --modes "${tr%%:*}" --allocators "${tr#*:}" --out "$out/torch_$i"
        done
      done
    done
    python3 - "$out" "$rounds" <<'EOF' | tee -a "$out/summary.txt"
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
runs = {}
for i in range(1, rounds + 1):
    try:
        lines = [json.loads(l) for l in open(f"{out}/torch_{i}/results.jsonl")]
    except OSError:
        continue
    for d in lines:
        if "error" in d:
            print(f"FAILED {d['workload']} {d['mode']} {d['allocator']}: {d['error'][-300:]}")
            continue
        runs.setdefault((d["workload"], d["allocator"], d["mode"]), []).append(d)
def spread(xs):
    return f"{statistics.median(xs):.1f} [{min(xs):.1f}-{max(xs):.1f}]"
# Steady: the median timed step (after the warm-up steps). First cycle: the steps after the first,
# summed (a dynamic-shape workload meets new shapes at every step); step 0 also loads kernels and
# libraries, which the first process of a round pays more for, so it is shown apart.
print("workload | allocator (mode) | runs | steady step ms | first cycle ms (steps 1..) | step 0 ms "
      "| step 1 ms | peak reserved GiB | steady / PyTorch | first cycle / PyTorch")
for w in sorted({k[0] for k in runs}):
    torch_runs = [d for k, ds in runs.items() if k[0] == w and k[1] == "torch" for d in ds]
    med = lambda ds, f: statistics.median(f(d) for d in ds) if ds else float("nan")
    t_steady = med(torch_runs, lambda d: d["median_step_ms"])
    t_cycle = med(torch_runs, lambda d: sum(d["step_ms"][1:]))
    rows = sorted(((k[1], k[2]), ds) for k, ds in runs.items() if k[0] == w and k[1] != "torch")
    rows = [(("torch", "all modes"), torch_runs)] + rows
    for (alloc, mode), ds in rows:
        if not ds:
            continue
        steady = [d["median_step_ms"] for d in ds]
        cycle = [sum(d["step_ms"][1:]) for d in ds]
        print(f"{w} | {alloc} ({mode}) | {len(ds)} | {spread(steady)} | {spread(cycle)} | "
              f"{spread([d['step_ms'][0] for d in ds])} | {spread([d['step_ms'][1] for d in ds])} | "
              f"{statistics.median(d['peak_reserved'] for d in ds) / 2**30:.3f} | "
              f"{statistics.median(steady) / t_steady:.3f} | {statistics.median(cycle) / t_cycle:.3f}")
EOF
    ;;
esac
exit $status
