#!/usr/bin/env bash
# Proof of libcucache_preload.so on a GPU: an unmodified CUDA program (tests/gpu/preload_program.cu),
# built with nvcc's default static runtime and with -cudart shared, runs plain and then under
# LD_PRELOAD in several configurations; every run must produce correct results, and every
# preloaded run's CUCACHE_REPORT must show cucache serving its allocations. Exit 77 (skipped)
# where there is no usable GPU.
#   tools/preload_check.sh BUILD_DIR [OUT_DIR]
set -uo pipefail
build=${1:?build dir}; out=${2:-$build/preload_check}
bin=$build/bin
shim=$build/lib/libcucache_preload.so
mkdir -p "$out"
for f in "$shim" "$bin/preload_program_static" "$bin/preload_program_shared"; do
  [[ -e $f ]] || { echo "preload_check: $f is missing (build with a CUDA compiler)"; exit 1; }
done
status=0
fail() { echo "preload_check: FAILED: $*"; status=1; }

# Without a GPU the plain program says so: skip.
"$bin/preload_program_static" > "$out/plain_static.log" 2>&1
rc=$?
if [[ $rc -eq 77 ]]; then
  echo "preload_check: skipped: $(tail -1 "$out/plain_static.log")"
  exit 77
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
[[ $rc -eq 0 ]] || fail "plain static run: exit $rc ($(tail -1 "$out/plain_static.log"))"
"$bin/preload_program_shared" > "$out/plain_shared.log" 2>&1 || fail "plain shared run: exit $?"

# Which runtime each build uses.
if ldd "$bin/preload_program_static" | grep -q libcudart; then fail "the static build links libcudart.so"; fi
ldd "$bin/preload_program_shared" | grep -q libcudart || fail "the shared build does not link libcudart.so"

# preload_program: 20 x (2 + 64) cudaMalloc, 20 cudaMallocAsync, 1 pitched, 1 more.
want_allocs=1342
run() {  # name, env..., -- args...
  local name=$1; shift
  local envs=()
  while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
  local variant=$1; shift
  local report="$out/$name.report.txt"
  rm -f "$report"
  env "${envs[@]}" LD_PRELOAD="$shim" CUCACHE_BACKEND=cuda CUCACHE_REPORT="$report" \
    "$bin/preload_program_$variant" --expect-ipc-refused "$@" > "$out/$name.log" 2>&1
  local rc=$?
  local line
  line=$(head -1 "$report" 2>/dev/null || true)
  echo "$name: exit $rc; $line" | tee -a "$out/summary.txt"
  [[ $rc -eq 0 ]] || { fail "$name: exit $rc: $(grep -v '^cucache preload:' "$out/$name.log" | tail -3)"; return; }
  grep -q "preload_program: OK" "$out/$name.log" || fail "$name: no OK line"
  local allocs
  allocs=$(sed -n 's/^cucache preload report: \([0-9]*\) allocations.*/\1/p' "$report")
  [[ -n $allocs && $allocs -ge $want_allocs ]] || fail "$name: report shows '${allocs:-no}' allocations, want >= $want_allocs"
  grep -q -- "--- device 0 ---" "$report" || fail "$name: no memory_summary in the report"
  grep -q "1 bad frees refused" "$report" || fail "$name: the interior free was not refused by cucache"
  grep -q "1 IPC handles refused" "$report" || fail "$name: cudaIpcGetMemHandle was not refused"
  grep -q "1 address ranges answered" "$report" || fail "$name: cuMemGetAddressRange was not cucache's"
  grep -q "cuIpcGetMemHandle(.*) refused" "$out/$name.log" || fail "$name: no loud IPC refusal on stderr"
  grep -q "3 replays right" "$out/$name.log" || fail "$name: the captured graph did not replay right"
  local captures="captures: announced (CUCACHE_PRELOAD_CAPTURES), 1 announced by the shim, 0 allocations"
  [[ " ${envs[*]} " == *CUCACHE_PRELOAD_CAPTURES=query* ]] &&
    captures="captures: query (CUCACHE_PRELOAD_CAPTURES), 0 announced by the shim, 0 allocations"
  grep -q "$captures" "$report" || fail "$name: want '$captures' in the report: $(grep '^captures:' "$report")"
  # Every run announces the program's cudaStreamDestroy (the shim interposes cuStreamDestroy_v2).
  local streams=query
  [[ " ${envs[*]} " == *CUCACHE_PRELOAD_STREAMS=announced* ]] && streams=announced
  local destroyed
  destroyed=$(sed -n "s/^streams: $streams (CUCACHE_PRELOAD_STREAMS), \([0-9]*\) destructions announced.*/\1/p" "$report")
  [[ -n $destroyed && $destroyed -ge 1 ]] ||
    fail "$name: want 'streams: $streams ..., N >= 1 destructions announced': $(grep '^streams:' "$report")"
}
for variant in static shared; do
  run "${variant}_default" -- "$variant"
  run "${variant}_expandable" CUCACHE_CONF=expandable_segments:True -- "$variant"
  run "${variant}_stream_free" CUCACHE_PRELOAD_FREE=stream -- "$variant"
  run "${variant}_reset" -- "$variant" --reset
done
run static_captures_query CUCACHE_PRELOAD_CAPTURES=query -- static
# The stream id cached per thread, every destruction announced by the shim (docs/preload.md,
# "Stream destructions").
run static_streams_announced CUCACHE_PRELOAD_STREAMS=announced -- static
run shared_streams_announced CUCACHE_PRELOAD_STREAMS=announced -- shared
run expandable_streams_announced CUCACHE_PRELOAD_STREAMS=announced CUCACHE_CONF=expandable_segments:True -- static
# A trace through CUCACHE_CONF, flushed at exit.
run static_trace CUCACHE_CONF=trace:"$out/trace.csv" -- static
[[ -s $out/trace.csv ]] || fail "static_trace: no trace written"
[[ $status -eq 0 ]] && echo "preload_check: OK ($out)"
exit $status
