#!/usr/bin/env bash
# Issue 24's H200 proof: sleep and wake in an RL-style loop (bench/torch/sleep_wake.py), one
# process per mode, then the verdicts. About 4-7 minutes on an H200 at the default size.
#   tools/gpu_sleep.sh BIN OUT
# BIN: the folder holding libcucache_torch.so (a build's lib/, e.g. build/lib); OUT: where the
# logs, one JSON per mode, summary.txt and verdict.txt go. Needs python3 with torch (CUDA) on the
# machine. Environment: SIZE (h200 | small | tiny; default h200), ROUNDS (default 5), MODES (default
# "sleep nosleep train_alone infer_alone tms"), TMS_LIMIT (seconds for the tms mode, default 100). torch_memory_saver is tried if it imports
# (pip install torch_memory_saver, its wheel carried to the machine); the tms mode otherwise
# reports that it does not import. Exit status 0 only if the verdicts pass: every mode run (tms
# aside) left a result that says ok -- a mode that fails or is killed does not -- and a mode left
# out of MODES is reported as not run.
set -uo pipefail
bin=${1:?BIN: the folder holding libcucache_torch.so}; out=${2:?OUT folder}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
size=${SIZE:-h200}; rounds=${ROUNDS:-5}
modes=${MODES:-"sleep nosleep train_alone infer_alone tms"}
mkdir -p "$out"
lib="$bin/libcucache_torch.so"
[[ -f $lib ]] || { echo "gpu_sleep.sh: no $lib" >&2; exit 2; }
source "$repo/tools/gpu_run.sh"
gpu_line | tee "$out/gpu.txt"
git -C "$repo" rev-parse HEAD >> "$out/gpu.txt" 2>/dev/null
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
export PYTHONPATH="$repo/python${PYTHONPATH:+:$PYTHONPATH}" CUCACHE_LIB="$lib"
export CUCACHE_CONF=${CUCACHE_CONF:-expandable_segments:True}
export CUBLAS_WORKSPACE_CONFIG=:4096:8
# Seconds per mode: the loop with sleep first (the point), the reference, the two alone, tms last.
declare -A limit=([sleep]=150 [nosleep]=120 [train_alone]=90 [infer_alone]=75 [tms]=${TMS_LIMIT:-100})
for m in $modes; do
  run "$m" "${limit[$m]:-120}" python3 "$repo/bench/torch/sleep_wake.py" --mode "$m" \
    --size "$size" --rounds "$rounds" --out "$out/$m.json"
done
python3 "$repo/bench/torch/sleep_wake.py" --compare "$out" --ran "$modes" | tee -a "$out/summary.txt"
rc=${PIPESTATUS[0]}
exit $rc
