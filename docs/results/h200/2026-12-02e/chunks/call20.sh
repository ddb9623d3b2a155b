#!/usr/bin/env bash
# Issue 20 on the H200: the replay's cold and warm passes of the seven traces in expandable mode,
# main (one-page handles) and h20-chunks (multi-page chunks for blocks >= 256 MiB) interleaved,
# three rounds, c10's expandable mode beside each (--peers c10).
set -u
echo "main $(cat .gpu/COMMIT) h20 $(cat .gpu/h20/COMMIT)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
bash tools/build_c10_peer.sh .gpu/build/bin > "$OUT/c10_build.log" 2>&1 || { echo "c10 peer build failed"; tail -5 "$OUT/c10_build.log"; }
cp .gpu/build/bin/libcucache_c10_peer.so .gpu/h20/bin/ 2>/dev/null
traces=(traces/*.csv.gz)
for i in 1 2 3; do
  for v in build h20; do
    start=$SECONDS
    timeout 170 ".gpu/$v/bin/cucache-replay" --backend cuda --json --warm \
      --config expandable_segments:True --peers c10 "${traces[@]}" \
      > "$OUT/replay_${v}_$i.jsonl" 2> "$OUT/replay_${v}_$i.err"
    echo "replay $v round $i: exit $? in $((SECONDS - start)) s"
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys, glob
out = sys.argv[1]
runs = {}
for v in ("build", "h20"):
    for i in (1, 2, 3):
        try:
            for l in open(f"{out}/replay_{v}_{i}.jsonl"):
                if l.startswith("{"):
                    d = json.loads(l); runs.setdefault((v, d["trace"]), []).append(d)
        except OSError:
            pass
med = lambda xs: statistics.median(xs) if xs else float("nan")
rng = lambda xs: f"{med(xs):.0f} [{min(xs):.0f}-{max(xs):.0f}]" if xs else "-"
print("trace | main cold ns/op | chunks cold ns/op | c10 cold ns/op | main/c10 | chunks/c10 | main warm | chunks warm | c10 warm | cold syncs main/chunks | creates main/chunks")
for t in sorted({k[1] for k in runs}):
    m, h = runs.get(("build", t), []), runs.get(("h20", t), [])
    mc = [d["host_ns_per_op"] for d in m]; hc = [d["host_ns_per_op"] for d in h]
    pc = [d["peers"]["c10"]["host_ns_per_op"] for d in m + h if "c10" in d.get("peers", {})]
    mw = [d["warm"]["host_ns_per_op"] for d in m]; hw = [d["warm"]["host_ns_per_op"] for d in h]
    pw = [d["peers"]["c10"]["warm"]["host_ns_per_op"] for d in m + h if "c10" in d.get("peers", {})]
    sy = lambda ds: ds[0].get("device_synchronizations", "?") if ds else "?"
    cr = lambda ds: ds[0].get("vm_calls", {}).get("create", "?") if ds else "?"
    print(f"{t} | {rng(mc)} | {rng(hc)} | {rng(pc)} | {med(mc)/med(pc):.2f} | {med(hc)/med(pc):.2f} | "
          f"{rng(mw)} | {rng(hw)} | {rng(pw)} | {sy(m)}/{sy(h)} | {cr(m)}/{cr(h)}")
PY
cd "$OUT" && tar czf results.tgz *.jsonl *.err summary.txt gpu.txt c10_build.log && rm -f *.jsonl *.err
