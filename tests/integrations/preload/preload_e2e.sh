#!/usr/bin/env bash
# libcucache_preload.so's interposition, end to end without a GPU: preload_e2e_check against a
# fake libcuda.so.1, first plain (the fake sees every call), then under LD_PRELOAD on the
# simulated device (cucache sees them), with CUCACHE_REPORT written at exit; and an ordinary
# program under the shim is unaffected.
#   preload_e2e.sh CHECK_BIN FAKE_LIB_DIR PRELOAD_LIB WORK_DIR
set -euo pipefail
check=$1 fake_dir=$2 shim=$3 work=$4
mkdir -p "$work"
report="$work/preload_report.txt"
rm -f "$report"
LD_LIBRARY_PATH="$fake_dir" "$check" plain
LD_LIBRARY_PATH="$fake_dir" LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT="$report" \
  "$check" preloaded
grep -q "cucache preload report: 3 allocations and 3 frees by cucache, 2 foreign frees" "$report" \
  || { echo "preload_e2e: unexpected report:"; cat "$report"; exit 1; }
grep -q -- "--- device 0 ---" "$report" || { echo "preload_e2e: no summary in report"; exit 1; }
# CUCACHE_REPORT=stderr, and a program that never touches CUDA.
out=$(LD_PRELOAD="$shim" CUCACHE_REPORT=stderr /bin/echo unaffected 2>&1)
[[ $out == *unaffected* ]] || { echo "preload_e2e: /bin/echo under the shim: $out"; exit 1; }
# Only the interposed symbols are exported.
if command -v nm > /dev/null; then
  extra=$(nm -D --defined-only "$shim" | awk '{print $3}' | grep -v -E '^(dlsym|cuGetProcAddress(_v2)?|cuMemAlloc_v2|cuMemAllocAsync(_ptsz)?|cuMemAllocPitch_v2|cuMemFree_v2|cuMemFreeAsync(_ptsz)?|cuMemGetInfo_v2|cuIpcGetMemHandle|cuMemGetAddressRange_v2)$' || true)
  [[ -z $extra ]] || { echo "preload_e2e: unexpected exports: $extra"; exit 1; }
fi
echo "preload_e2e: OK"
