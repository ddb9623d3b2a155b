#!/usr/bin/env bash
# The GPU runs behind docs/benchmarks.md, all from one commit's binaries and libraries, in four
# parts that each fit one 10-minute call of the device tool (run them back to back):
#   tools/gpu_benchmarks.sh BIN LIB OUT host   -- cucache-bench: the cache-hit pair on a created
#       and on the legacy stream, churn, threads, cucache's six settings (both modes; captures
#       announced; captures and stream destructions announced) against c10 and cudaMallocAsync (3
#       interleaved repetitions), and the cost of each stream query; the seven bundled traces cold
#       and warm, expandable segments against c10's expandable mode (ROUNDS interleaved rounds,
#       gpu_expandable.sh replay)
#   tools/gpu_benchmarks.sh BIN LIB OUT memory -- minimum capacity (--fit) of every bundled trace in
#       both modes against the peers; the cost of each device call (cucache-vm-cost)
#   tools/gpu_benchmarks.sh BIN LIB OUT sleep  -- the warm pass in default mode against c10 and
#       cudaMallocAsync; sleep and wake of issue 33's shape (sleep_breakdown.py, with and without
#       --prepare); the RL loop (gpu_sleep.sh, sleep and nosleep modes, 3 rounds)
#   tools/gpu_benchmarks.sh BIN LIB OUT torch  -- training steps through the plug-in against
#       PyTorch's allocator (gpu_expandable.sh torch); the programs of the torch extension
#       (gpu_torch_face.sh programs: torch.compile, shared-pool graphs, IPC, memory_viz snapshot)
# BIN: the staged binaries (tools/gpu_stage.sh; BIN/COMMIT names their commit) -- the c10 peer is
# built into it first when missing (tools/build_c10_peer.sh, needs torch); LIB: the folder holding
# libcucache_torch.so and libcucache_torch_hooks.so of the same commit. Writes gpu.txt, one log per
# run and summary.txt into OUT; exit status 0 only if every run exited 0.
set -uo pipefail
bin=${1:?BIN: staged binaries}; lib=${2:?LIB: folder of libcucache_torch.so}
out=${3:?OUT folder}; part=${4:?host, memory, sleep or torch}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
case $part in host|memory|sleep|torch) ;; *)
  echo "gpu_benchmarks.sh: unknown part '$part' (host, memory, sleep, torch)" >&2; exit 2 ;;
esac
mkdir -p "$out"
source "$repo/tools/gpu_run.sh"
{
  gpu_line
  echo "binaries of commit $(cat "$bin/COMMIT" 2>/dev/null || echo unknown)"
  python3 -c 'import torch; print("torch", torch.__version__)' 2>/dev/null
} | tee "$out/gpu.txt"
traces=("$repo"/traces/*.csv.gz)
if [[ $part != torch && ! -f $bin/libcucache_c10_peer.so ]]; then
  run build_c10_peer 120 bash "$repo/tools/build_c10_peer.sh" "$bin"
fi
export ROUNDS=${ROUNDS:-2}
case $part in
  host)
    settings='cucache_cuda|cucache_cuda_expandable|cucache_cuda_announced|cucache_cuda_expandable_announced'
    settings+='|cucache_cuda_streams_announced|cucache_cuda_expandable_streams_announced'
    run bench 200 "$bin/cucache-bench" \
      "--benchmark_filter=^((pair|pair_legacy|churn_small|churn_large|threads|threads_one_stream)/($settings|c10|cudaMallocAsync)(/|\$)|stream_query/)" \
      --benchmark_min_time=0.05 --benchmark_repetitions=3 --benchmark_enable_random_interleaving=true \
      --benchmark_report_aggregates_only=true --benchmark_format=json "--benchmark_out=$out/bench.json"
    run replay_expandable 330 bash "$repo/tools/gpu_expandable.sh" "$bin" "$out/expandable" replay
    ;;
  memory)
    run fit_expandable 240 "$bin/cucache-replay" --backend cuda --fit --json \
      --config expandable_segments:True --peers c10 "${traces[@]}"
    run fit_default 240 "$bin/cucache-replay" --backend cuda --fit --json \
      --peers c10,cudaMallocAsync "${traces[@]}"
    run vm_cost 90 "$bin/cucache-vm-cost" 30
    ;;
  sleep)
    run replay_default_warm 90 "$bin/cucache-replay" --backend cuda --json --warm --repeat 3 \
      --peers c10,cudaMallocAsync "${traces[@]}"
    for prepare in "" --prepare; do
      run "sleep_breakdown${prepare}" 100 env CUCACHE_LIB="$lib/libcucache_torch.so" \
        PYTHONPATH="$repo/python" CUCACHE_CONF=expandable_segments:True \
        python3 "$repo/bench/torch/sleep_breakdown.py" $prepare
    done
    export ROUNDS=3 MODES="sleep nosleep"  # gpu_sleep.sh's rounds
    run rl_loop 240 bash "$repo/tools/gpu_sleep.sh" "$lib" "$out/rl"
    ;;
  torch)
    export CUCACHE_LIB="$lib/libcucache_torch.so" PYTHONPATH="$repo/python"
    export CUCACHE_TORCH_HOOKS_LIB="$lib/libcucache_torch_hooks.so"
    export WORKLOADS=${WORKLOADS:-gpt2_train,resnet50_train}
    run steps 330 bash "$repo/tools/gpu_expandable.sh" "$bin" "$out/steps" torch
    run programs 300 env OUT="$out/programs" CUCACHE_GPU_LIB="$lib" \
      bash "$repo/tools/gpu_torch_face.sh" programs
    ;;
esac
exit $status
