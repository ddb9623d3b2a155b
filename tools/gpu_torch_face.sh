#!/usr/bin/env bash
# cucache as torch's allocator on a GPU (issue 29), in one call on the device machine:
#
#   bash tools/gpu_torch_face.sh [build|tests|programs|all]    (default all; results under $OUT)
#
#   build     configures against the machine's torch and builds the plug-in and the extension
#   tests     PyTorch's own test_cuda.py selection (run_tests.py) under torch's allocator, cucache
#             default mode and cucache expandable mode (ipc_handles on): RESULT lines to
#             $OUT/pytorch_tests_<alloc>_<mode>.txt and one line per run in $OUT/summary.txt.
#             The runner is read from shared/pytorch_tests in the checkout (the device copies a
#             checkout's shared/ folder; copy /work/shared/pytorch_tests there, ignored through
#             .git/info/exclude, never committed) or from $PYTORCH_TESTS.
#   programs  bench/torch/torch_face.py: torch.compile(mode="reduce-overhead") vs eager, a manual
#             CUDA graph with a shared pool, a CUDA tensor through torch.multiprocessing (read and
#             written by the child), a _dump_snapshot of a training step loaded by _memory_viz --
#             under cucache in both modes (and torch's allocator as the control)
#
# Knobs (environment):
#   CUCACHE_GPU_LIB  folder holding libcucache_torch.so and libcucache_torch_hooks.so built
#                    elsewhere against the same torch and carried (then nothing is built here)
#   SPECS            which runs, "allocator mode" pairs separated by ';' (default: the torch
#                    control, cucache default, cucache expandable)
#   SELECT           a regex of "<Class>.<test>" ids: only those tests (run_tests.py's SELECT),
#                    e.g. SELECT='TestMemPool|test_memory_plots|test_memory_stats$'
#   CASES            the programs to run (default "compile graph ipc snapshot")
#   RUN_TIMEOUT      seconds for one whole test run (default 240), under `timeout`, so that one
#                    hanging run never eats the others; PROG_TIMEOUT likewise per program
#                    (default 150); TIMEOUT per test (default 60)
#
# Budget: build ~2 min, a full test run ~4 min, programs ~2 min per allocator: the three full
# runs do not fit one 10-minute call; use SELECT, SPECS or the parts in separate calls.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
part=${1:-all}
out=${OUT:-$repo/out-torch-face}
mkdir -p "$out"
cd "$repo"
py=${PYTHON:-python3}
# The libraries: built here by `build`, or built elsewhere against the same torch and carried
# (CUCACHE_GPU_LIB=folder holding libcucache_torch.so and libcucache_torch_hooks.so).
lib=${CUCACHE_GPU_LIB:-$repo/build-gpu/lib}
# Which runs: "allocator mode" pairs (default all three).
specs=${SPECS:-"torch default;cucache default;cucache expandable"}
cases=${CASES:-"compile graph ipc snapshot"}
run_timeout=${RUN_TIMEOUT:-240}
prog_timeout=${PROG_TIMEOUT:-150}
summary=$out/summary.txt

build() {
  local start=$SECONDS torch_dir
  torch_dir=$("$py" -c 'import torch, os; print(os.path.dirname(torch.__file__))') || return 1
  { cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCUCACHE_TORCH_DIR="$torch_dir" -DCUCACHE_BUILD_TESTS=OFF \
      -DCUCACHE_BUILD_BENCHMARKS=OFF -DCUCACHE_BUILD_EXAMPLES=OFF -DCUCACHE_BUILD_TOOLS=OFF &&
    cmake --build build-gpu -j"$(nproc)" --target cucache_torch cucache_torch_hooks; } > "$out/build.log" 2>&1
  local rc=$?
  echo "build: exit $rc in $((SECONDS - start)) s (torch $("$py" -c 'import torch; print(torch.__version__)'))" | tee -a "$summary"
  return $rc
}

tests() {
  local runner=${PYTORCH_TESTS:-$repo/shared/pytorch_tests}
  if [ ! -f "$runner/run_tests.py" ]; then
    echo "tests: SKIPPED: no $runner/run_tests.py (copy /work/shared/pytorch_tests to shared/pytorch_tests in the checkout)" | tee -a "$summary"
    return 0
  fi
  local alloc mode conf name start
  local -a runs
  IFS=';' read -r -a runs <<<"$specs"
  for spec in "${runs[@]}"; do
    read -r alloc mode <<<"$spec"
    name=pytorch_tests_${alloc}_${mode}
    conf=""
    [ "$mode" = expandable ] && conf="expandable_segments:True,ipc_handles:True"
    start=$SECONDS
    if [ "$alloc" = torch ]; then
      env -u CUCACHE_CONF TIMEOUT=${TIMEOUT:-60} timeout -k 10 "$run_timeout" \
        "$py" "$runner/run_tests.py" > "$out/$name.txt" 2> "$out/$name.err"
    else
      env CUCACHE_CONF="$conf" ALLOC=cucache HOOKS=1 CUCACHE_PY="$repo/python" \
        CUCACHE_LIB="$lib/libcucache_torch.so" CUCACHE_TORCH_HOOKS_LIB="$lib/libcucache_torch_hooks.so" \
        TIMEOUT=${TIMEOUT:-60} timeout -k 10 "$run_timeout" \
        "$py" "$runner/run_tests.py" > "$out/$name.txt" 2> "$out/$name.err"
    fi
    local rc=$?
    [ "$rc" = 124 ] && echo "RESULT <run> timeout: the whole run passed RUN_TIMEOUT=$run_timeout s" >> "$out/$name.txt"
    echo "$name: exit $rc in $((SECONDS - start)) s${SELECT:+ (SELECT=$SELECT)}: $(grep '^SUMMARY' "$out/$name.txt" || echo 'no SUMMARY')" | tee -a "$summary"
  done
  # Tests passing under torch's allocator but not under cucache, per mode.
  for mode in default expandable; do
    [ -f "$out/pytorch_tests_torch_default.txt" ] && [ -f "$out/pytorch_tests_cucache_$mode.txt" ] || continue
    comm -23 <(grep '^RESULT .* pass' "$out/pytorch_tests_torch_default.txt" | awk '{print $2}' | sort) \
             <(grep '^RESULT .* pass' "$out/pytorch_tests_cucache_$mode.txt" | awk '{print $2}' | sort) \
      > "$out/regressions_$mode.txt"
    echo "passing under torch, not under cucache $mode: $(wc -l < "$out/regressions_$mode.txt")" | tee -a "$summary"
  done
}

programs() {
  local alloc mode conf c start rc failed=0
  local -a runs
  IFS=';' read -r -a runs <<<"$specs"
  for spec in "${runs[@]}"; do
    read -r alloc mode <<<"$spec"
    conf=""
    [ "$mode" = expandable ] && conf="expandable_segments:True,ipc_handles:True"
    for c in $cases; do
      start=$SECONDS
      env CUCACHE_CONF="$conf" ALLOC="$alloc" MODE="$mode" CUCACHE_LIB="$lib/libcucache_torch.so" \
        CUCACHE_TORCH_HOOKS_LIB="$lib/libcucache_torch_hooks.so" \
        timeout -k 10 "$prog_timeout" "$py" bench/torch/torch_face.py "$c" --out "$out" > "$out/prog_${alloc}_${mode}_$c.log" 2>&1
      rc=$?
      (( rc == 0 )) || failed=1
      echo "program $c ($alloc $mode): exit $rc in $((SECONDS - start)) s: $(grep '^RESULT' "$out/prog_${alloc}_${mode}_$c.log" | tail -1)" | tee -a "$summary"
    done
  done
  return $failed
}

# The extension where CUCACHE_GPU_LIB lacks it: built here, and every run then takes both
# libraries from the build (a plug-in and an extension of one build).
need_hooks() {
  [ -f "$lib/libcucache_torch_hooks.so" ] && return 0
  build || return 1
  lib=$repo/build-gpu/lib
}

case $part in
  build) build ;;
  tests) need_hooks && tests ;;
  programs) need_hooks && programs ;;
  all) need_hooks && tests && programs ;;
  *) echo "usage: $0 [build|tests|programs|all]" >&2; exit 2 ;;
esac
