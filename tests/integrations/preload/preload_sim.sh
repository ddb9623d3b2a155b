#!/usr/bin/env bash
# README's and docs/preload.md's "try the shim without a GPU": a plain C program (cudaMalloc,
# cudaMallocAsync, cudaMallocPitch, cudaMemGetInfo, cudaFree, cudaFreeAsync, a double free)
# linked with the shared CUDA runtime runs under LD_PRELOAD=libcucache_preload.so with
# CUCACHE_BACKEND=sim and CUCACHE_REPORT=stderr; cucache's report must show its allocations.
# The same program with the static runtime cannot start without a driver: the shim must then say
# so on stderr instead of staying silent (with a driver, its report must show the allocations).
#   preload_sim.sh SHARED_PROGRAM STATIC_PROGRAM PRELOAD_LIB
set -uo pipefail
shared=$1 static=$2 shim=$3
fail() { echo "preload_sim: $*"; exit 1; }

out=$(LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT=stderr "$shared" 2>&1)
rc=$?
((rc == 0)) || fail "shared runtime under the shim exited $rc:"$'\n'"$out"
[[ $out == *OK* ]] || fail "shared runtime under the shim: no OK:"$'\n'"$out"
grep -q "cucache preload report: 3 allocations and 3 frees by cucache" <<< "$out" \
  || fail "shared runtime under the shim: no report of 3 allocations and 3 frees:"$'\n'"$out"
grep -q -- "--- device 0 ---" <<< "$out" || fail "no memory_summary in the report:"$'\n'"$out"
grep -q "backend sim" <<< "$out" || fail "the report does not name the sim backend:"$'\n'"$out"

out=$(LD_PRELOAD="$shim" CUCACHE_BACKEND=sim CUCACHE_REPORT=stderr "$static" 2>&1)
if ldconfig -p 2> /dev/null | grep -q 'libcuda\.so\.1 '; then
  grep -q "cucache preload report: 3 allocations" <<< "$out" \
    || fail "static runtime under the shim with a driver: no report:"$'\n'"$out"
else
  grep -q "cucache preload: nothing reached cucache in .*no CUDA driver (libcuda.so.1) is loaded" \
    <<< "$out" || fail "static runtime without a driver: the shim said nothing:"$'\n'"$out"
  grep -q "libcudart.so" <<< "$out" || fail "the notice does not point at the shared runtime:"$'\n'"$out"
fi
echo "preload_sim: OK"
