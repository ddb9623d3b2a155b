#!/usr/bin/env bash
# Runs the GPU test binaries (both allocator modes), optionally under compute-sanitizer, writing
# one log per run into OUT_DIR. Used on the H200 through the device tool; see docs/verified.md.
#   tools/gpu_suite.sh BIN_DIR OUT_DIR [memcheck|racecheck|synccheck|initcheck]
set -uo pipefail
bin=${1:?bin dir}; out=${2:?out dir}; mode=${3:-}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$out/gpu.txt"
prefix=()
case $mode in
  "") ;;
  memcheck)
    # OOM tests make the runtime return errors on purpose: report memory errors and leaks only.
    prefix=(compute-sanitizer --tool memcheck --leak-check full --report-api-errors no --error-exitcode 97) ;;
  racecheck|synccheck|initcheck)
    prefix=(compute-sanitizer --tool "$mode" --report-api-errors no --error-exitcode 97) ;;
  *) echo "gpu_suite.sh: unknown mode '$mode' (memcheck, racecheck, synccheck, initcheck)" >&2; exit 2 ;;
esac
status=0
run() {  # name, env..., binary, args...
  local name=$1; shift
  local start=$SECONDS
  env "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')" | tee -a "$out/summary.txt"
  [[ $rc -ne 0 ]] && status=1
}
for t in cuda_backend_gpu_test allocator_gpu_test expandable_gpu_test global_gpu_test allocator_suite_cuda_test streams_gpu_test \
  graph_capture_gpu_test ipc_gpu_test multi_gpu_test; do
  [[ -x $bin/$t ]] || continue
  run "$t" "${prefix[@]}" "$bin/$t"
done
if [[ -x $bin/allocator_gpu_test ]]; then
  run allocator_gpu_test_expandable CUCACHE_GPU_TEST_CONF=expandable_segments:True "${prefix[@]}" \
    "$bin/allocator_gpu_test"
fi
if [[ -x $bin/process_exit_gpu_check ]]; then
  for conf in "" expandable_segments:True; do
    for scenario in stream record_stream threads loop; do
      run "process_exit_${conf:+expandable_}${scenario}" CUCACHE_BACKEND=cuda CUCACHE_CONF="$conf" \
        "${prefix[@]}" "$bin/process_exit_gpu_check" "$scenario"
    done
  done
fi
for e in port_before port_after; do
  [[ -x $bin/$e ]] && run "example_$e" "${prefix[@]}" "$bin/$e"
done
exit $status
