#!/usr/bin/env bash
# Issue 33's two-process colocation on the H200 (bench/torch/colocate.py): a trainer and a
# generator process on one GPU, weights sent by CUDA IPC each round, each asleep while the other
# runs; one run per mode, then the verdicts. About 4-6 minutes at the default size.
#   tools/gpu_colocate.sh BIN OUT
# BIN: the folder holding libcucache_torch.so and libcucache_torch_hooks.so (built against the
# machine's torch); OUT: the logs, one JSON per mode, summary.txt and verdict.txt. Environment:
# SIZE (h200 | small | tiny; default h200), ROUNDS (default 3), MODES (default "sleep nosleep
# train_alone infer_alone"), LIMIT (seconds per mode, default 200). Exit status 0 only if every mode ran and the verdicts pass.
set -uo pipefail
bin=${1:?BIN: the folder holding libcucache_torch.so}; out=${2:?OUT folder}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
size=${SIZE:-h200}; rounds=${ROUNDS:-3}
modes=${MODES:-"sleep nosleep train_alone infer_alone"}
mkdir -p "$out"
lib="$bin/libcucache_torch.so"
[[ -f $lib ]] || { echo "gpu_colocate.sh: no $lib" >&2; exit 2; }
source "$repo/tools/gpu_run.sh"
gpu_line | tee "$out/gpu.txt"
git -C "$repo" rev-parse HEAD >> "$out/gpu.txt" 2>/dev/null
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}" CUCACHE_LIB="$lib"
export CUCACHE_CONF=${CUCACHE_CONF:-expandable_segments:True,ipc_handles:True}
export CUBLAS_WORKSPACE_CONFIG=:4096:8
for m in $modes; do
  run "coloc_$m" "${LIMIT:-200}" python3 "$repo/bench/torch/colocate.py" --mode "$m" --size "$size" \
    --rounds "$rounds" --timeout $(( ${LIMIT:-200} - 20 )) --out "$out/$m.json"
done
python3 "$repo/bench/torch/colocate.py" --compare "$out" | tee -a "$out/summary.txt"
rc=${PIPESTATUS[0]}
exit $((rc | status))
