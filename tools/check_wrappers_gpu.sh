#!/usr/bin/env bash
# On a GPU: the checks of the backend wrappers and of the shared tools folder that need a device.
# The replay's counting and recording backends forward the IPC and peer-access calls
# (forwarding_backend), so ipc_handles:True and peer_access: reach cuda_backend in every mode; the
# c10 peer builds from tools/common (where it moved from bench/peers) and loads with both of
# PyTorch's variables set. A few minutes on an H200.
#   tools/check_wrappers_gpu.sh BIN_DIR OUT_DIR
# BIN_DIR holds cucache-replay and graph_capture_gpu_test (and receives libcucache_c10_peer.so
# when torch is installed). Writes one log per run and summary.txt into OUT_DIR; exit status 0
# only if every run exited 0.
set -uo pipefail
bin=${1:?bin dir}; out=${2:?out dir}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
trace=$repo/traces/bert_serve.csv.gz
mkdir -p "$out"
status=0
run() {  # name, command...
  local name=$1; shift
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc; $(tail -n 2 "$out/$name.log" | tr '\n' ' ')" | tee -a "$out/summary.txt"
  [[ $rc -ne 0 ]] && status=1
}
for conf in expandable_segments:True,ipc_handles:True expandable_segments:True,peer_access:none \
            expandable_segments:True,peer_access:all ipc_handles:True; do
  run "replay_${conf//[:,]/_}" "$bin/cucache-replay" --backend cuda --json --config "$conf" "$trace"
  run "replay_warm_${conf//[:,]/_}" "$bin/cucache-replay" --backend cuda --json --warm \
    --config "$conf" "$trace"
done
run replay_timeline_ipc "$bin/cucache-replay" --backend cuda --json \
  --config expandable_segments:True,ipc_handles:True --timeline "$out/timeline.html" "$trace"
[[ -x $bin/graph_capture_gpu_test ]] && run graph_capture_gpu "$bin/graph_capture_gpu_test"
if python3 -c 'import torch' 2>/dev/null; then
  run build_c10_peer bash "$repo/tools/build_c10_peer.sh" "$bin"
  PYTORCH_ALLOC_CONF=max_split_size_mb:64 run replay_c10 "$bin/cucache-replay" --backend cuda \
    --peers c10 --config expandable_segments:True "$repo/traces/resnet50_train.csv.gz"
else
  echo "c10 peer: skipped (no torch in this Python)" | tee -a "$out/summary.txt"
fi
exit $status
