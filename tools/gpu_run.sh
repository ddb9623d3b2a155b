# Sourced by the GPU scripts (gpu_figures.sh, gpu_expandable.sh, fastpath_gpu.sh): one way to run
# a step on the H200 and record it. The sourcing script sets `out` (its output folder) first.
#   run NAME SECONDS COMMAND...  COMMAND under `timeout SECONDS`, its output in $out/NAME.log and
#                                one line in $out/summary.txt: exit status, seconds, and the
#                                gtest and compute-sanitizer summary lines; status=1 if it failed
#   gpu_line                     the GPU, its driver, memory and compute capability (CSV)
status=0
run() {
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - start)) s; $(grep -h -E 'SUMMARY|^\[  (PASSED|FAILED|SKIPPED) ' "$out/$name.log" | tr '\n' ' ')" | tee -a "$out/summary.txt"
  [[ $rc -ne 0 ]] && status=1
}
gpu_line() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
}
