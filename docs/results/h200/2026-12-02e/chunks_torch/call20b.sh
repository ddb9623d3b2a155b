#!/usr/bin/env bash
# Issue 20 on the H200: does chunking cost a real model's first training step? gpt2_train and
# resnet50_train through the plug-in in expandable mode, main and h20-chunks interleaved, three
# rounds (6 steps each), PyTorch's expandable mode once per workload for reference.
set -u
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
echo "main $(cat .gpu/COMMIT) h20 $(cat .gpu/h20/COMMIT)"
one() {  # variant workload round
  local v=$1 w=$2 i=$3 start=$SECONDS
  if [[ $v == torch ]]; then
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 170 python3 bench/torch/run_workloads.py \
      --child --workload "$w" --mode expandable --allocator torch --steps 6 --hooks off \
      > "$OUT/${w}_${v}_$i.out" 2>&1
  else
    CUCACHE_CONF=expandable_segments:True CUCACHE_LIB=$PWD/.gpu/$v/lib/libcucache_torch.so \
      timeout 170 python3 bench/torch/run_workloads.py --child --workload "$w" --mode expandable \
      --allocator cucache --steps 6 --hooks off > "$OUT/${w}_${v}_$i.out" 2>&1
  fi
  echo "$w $v $i: exit $? in $((SECONDS - start)) s"
}
for w in gpt2_train resnet50_train; do one torch "$w" 1; done
for i in 1 2 3; do
  for v in build h20; do
    for w in gpt2_train resnet50_train; do one "$v" "$w" "$i"; done
  done
done
python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, statistics, sys, glob, os
out = sys.argv[1]
rows = {}
for f in sorted(glob.glob(f"{out}/*.out")):
    w, v, i = os.path.basename(f)[:-4].rsplit("_", 2)
    for l in open(f):
        if l.startswith("RESULT "):
            d = json.loads(l[7:]); rows.setdefault((w, v), []).append(d["step_ms"])
print("workload | variant | first step ms (runs) | second step ms | median of steps 3+")
for (w, v), runs in sorted(rows.items()):
    print(f"{w} | {v} | {', '.join(f'{r[0]:.0f}' for r in runs)} | {', '.join(f'{r[1]:.0f}' for r in runs)} | "
          f"{', '.join(f'{statistics.median(r[2:]):.1f}' for r in runs)}")
PY
tail -3 "$OUT"/gpt2_train_build_1.out
cd "$OUT" && tar czf results.tgz *.out summary.txt && rm -f *.out
