#!/usr/bin/env bash
# libcucache_preload.so's interposition, end to end without a GPU: preload_e2e_check against a
# fake libcuda.so.1, first plain (the fake sees every call), then under LD_PRELOAD on the
# simulated device (cucache sees them), with CUCACHE_REPORT written at exit; a forked child's free
# and exit (no report over the parent's); and an ordinary program under the shim is unaffected.
#   preload_e2e.sh CHECK_BIN FAKE_LIB_DIR PRELOAD_LIB WORK_DIR
set -euo pipefail
check=$1 fake_dir=$2 shim=$3 work=$4
mkdir -p "$work"
report="$work/preload_report.txt"
rm -f "$report"
LD_LIBRARY_PATH="$fake_dir" "$check" plain
LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT="$report" \
  "$check" preloaded
grep -q "cucache preload report: 5 allocations and 5 frees by cucache, 3 foreign frees" "$report" \
  || { echo "preload_e2e: unexpected report:"; cat "$report"; exit 1; }
grep -q -- "--- device 0 ---" "$report" || { echo "preload_e2e: no summary in report"; exit 1; }
grep -q "1 address ranges answered" "$report" || { echo "preload_e2e: no address range:"; cat "$report"; exit 1; }
grep -q "^streams: query (CUCACHE_PRELOAD_STREAMS), 4 destructions announced" "$report" \
  || { echo "preload_e2e: no stream destructions in the report:"; cat "$report"; exit 1; }
# CUCACHE_PRELOAD_STREAMS: announced in the report; a bad value named on stderr, query used.
LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT="$report" \
  CUCACHE_PRELOAD_STREAMS=announced "$check" preloaded > /dev/null
grep -q "^streams: announced (CUCACHE_PRELOAD_STREAMS), 4 destructions announced" "$report" \
  || { echo "preload_e2e: CUCACHE_PRELOAD_STREAMS=announced not in the report:"; cat "$report"; exit 1; }
err=$(LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT="$report" \
  CUCACHE_PRELOAD_STREAMS=cached "$check" preloaded 2>&1 > /dev/null)
grep -q "CUCACHE_PRELOAD_STREAMS: 'cached' is neither announced nor query; using query" <<< "$err" \
  || { echo "preload_e2e: CUCACHE_PRELOAD_STREAMS=cached not named on stderr: $err"; exit 1; }
grep -q "^streams: query (CUCACHE_PRELOAD_STREAMS)" "$report" \
  || { echo "preload_e2e: CUCACHE_PRELOAD_STREAMS=cached did not fall back to query:"; cat "$report"; exit 1; }
# A forked child that exits after its parent: its free of the parent's pointer fails without
# reaching the driver, and it writes no report over the parent's. fd 9 is locked before the program
# starts and the child inherits it, so the second flock returns only once the child has exited
# (and run its exit handlers): the lock is released when the last descriptor of it closes.
rm -f "$report" "$work/fork_verdict"
( flock 9
  LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT="$report" \
    "$check" fork "$work/fork_verdict" ) 9> "$work/fork.lock"
flock -w 30 "$work/fork.lock" true || { echo "preload_e2e: the forked child did not exit"; exit 1; }
grep -q OK "$work/fork_verdict" 2> /dev/null \
  || { echo "preload_e2e: forked child: $(cat "$work/fork_verdict" 2> /dev/null || echo no verdict)"; exit 1; }
grep -q "cucache preload report: 3 allocations and 3 frees by cucache, 0 foreign frees" "$report" \
  || { echo "preload_e2e: the parent's report was not kept:"; cat "$report"; exit 1; }
# CUCACHE_REPORT=PATH%p: one report per process.
rm -f "$work"/pid_report.*
LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim \
  CUCACHE_REPORT="$work/pid_report.%p" "$check" preloaded > /dev/null
ls "$work"/pid_report.[0-9]* > /dev/null 2>&1 || { echo "preload_e2e: no pid_report.<pid>"; exit 1; }
# CUCACHE_PRELOAD_TRACE=1: the lookups the shim answers, and who asked.
trace=$(LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_PRELOAD_TRACE=1 \
  "$check" preloaded 2>&1 > /dev/null)
for want in "cuGetProcAddress_v2(cuMemAlloc, 12000) from .*preload_e2e_check -> cucache" \
  "cuGetProcAddress_v2(cuMemAlloc, 3000) from .*preload_e2e_check -> driver" \
  "dlsym(cuMemAlloc_v2, 0) from .*preload_e2e_check -> cucache"; do
  grep -q "cucache preload trace: $want" <<< "$trace" \
    || { echo "preload_e2e: no trace line '$want' in:"; echo "$trace"; exit 1; }
done
# CUCACHE_REPORT=stderr, and a program that never touches CUDA.
out=$(LD_PRELOAD="$shim" CUCACHE_REPORT=stderr /bin/echo unaffected 2>&1)
[[ $out == *unaffected* ]] || { echo "preload_e2e: /bin/echo under the shim: $out"; exit 1; }
# Only the interposed symbols are exported.
if command -v nm > /dev/null; then
  extra=$(nm -D --defined-only "$shim" | awk '{print $3}' | grep -v -E '^(dlsym|cuGetProcAddress(_v2)?|cuMemAlloc_v2|cuMemAllocAsync(_ptsz)?|cuMemAllocFromPoolAsync(_ptsz)?|cuMemAllocPitch_v2|cuMemFree_v2|cuMemFreeAsync(_ptsz)?|cuMemGetInfo_v2|cuIpcGetMemHandle|cuMemGetAddressRange_v2|cuMemRetainAllocationHandle|cuStreamBeginCapture(_v2|ToGraph)(_ptsz)?|cuStreamEndCapture(_ptsz)?|cuStreamDestroy(_v2)?|cuda(Malloc|MallocAsync|MallocPitch|Free|FreeAsync|MemGetInfo)@libcudart\.so\.1[23]|libcudart\.so\.1[23])$' || true)
  [[ -z $extra ]] || { echo "preload_e2e: unexpected exports: $extra"; exit 1; }
fi
echo "preload_e2e: OK"
