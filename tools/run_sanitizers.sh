#!/usr/bin/env bash
# Builds the tests under a sanitizer and runs them (docs/testing.md). Used by .ci/run; the same
# command works by hand:
#
#   bash tools/run_sanitizers.sh asan   # AddressSanitizer + LeakSanitizer + UBSan, build-asan/
#   bash tools/run_sanitizers.sh tsan   # ThreadSanitizer, build-tsan/
#
# ASan: every test of the suite, the stress label and the randomized tests at 0.1 of their size.
# TSan: the test programs that start threads (see cmake_args below), the 16-thread stress at 0.2.
# GPU tests are built only where a GPU is present (/dev/nvidiactl). CUCACHE_STRESS_SCALE overrides
# the factor. Any sanitizer report fails the test it came from: UBSan is built non-recovering, ASan
# and TSan exit non-zero. No suppressions.
# Extra arguments go to ctest (e.g. -R Concurrency). CUCACHE_SAN_BUILD_DIR overrides the folder.
set -euo pipefail
cd "$(dirname "$0")/.."

kind=${1:?usage: run_sanitizers.sh asan|tsan [ctest arguments]}
shift
case "$kind" in
  asan) sanitize=address,undefined ;;
  tsan) sanitize=thread ;;
  *) echo "run_sanitizers.sh: unknown kind '$kind' (asan or tsan)" >&2; exit 2 ;;
esac
dir=${CUCACHE_SAN_BUILD_DIR:-build-$kind}
jobs=$(nproc)

# detect_stack_use_after_return and the initialization-order checks are off by default; leaks
# are checked at every test process's exit. A CUDA driver needs the shadow gap unprotected (it
# maps memory there), so protect_shadow_gap=0 is added only where a GPU is present.
asan_options="detect_leaks=1:detect_stack_use_after_return=1:check_initialization_order=1"
asan_options+=":strict_init_order=1:strict_string_checks=1"
if [[ -e /dev/nvidiactl ]]; then asan_options+=":protect_shadow_gap=0"; fi
export ASAN_OPTIONS=${ASAN_OPTIONS:-$asan_options}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:second_deadlock_stack=1:history_size=4}
# ASan runs a tenth of the million checked operations (the whole million is 10 CPU-minutes
# there, 2.5 times the Release build's), of the 16-thread stress and of the randomized tests'
# operations (scaled_ops in tests/support/sim_device.hpp; the Release build runs them whole); TSan a fifth of the 16-thread
# stress (about ten times slower there; the single-threaded runs are not given to it, see below).
if [[ $kind == asan ]]; then
  export CUCACHE_STRESS_SCALE=${CUCACHE_STRESS_SCALE:-0.1}
else
  export CUCACHE_STRESS_SCALE=${CUCACHE_STRESS_SCALE:-0.2}
fi
# Under TSan only what runs threads matters: the library starts no thread of its own, so a test
# program that starts none gives TSan nothing to check. CUCACHE_TEST_THREADED_ONLY builds only the
# test programs whose source starts threads (tests/CMakeLists.txt: Concurrency.*, the pool mutex,
# the C API and global API tests with threads, the trace recorder's writers, the block map, the
# 16-thread stress, ...) and none of the tools, examples or plug-ins; of those programs, the one
# single-threaded randomized run (Modes/GraphCapture.Randomized*) is ASan's too. Building only
# these took the TSan job from about 1,280 s to the figure docs/testing.md gives.
# CUCACHE_TSAN_ALL=1 builds and runs everything.
# preload_e2e is given to neither: it LD_PRELOADs a shim that interposes dlsym into the
# instrumented program, and the sanitizer runtimes must come first in the library list and
# intercept dlsym themselves (ASan refuses to start, TSan crashes at start; seen in CI). The
# Release build runs it, and the H200 runs the shim on real programs (tools/preload_check.sh).
ctest_args=(-E '^preload_e2e$')
cmake_args=()
if [[ $kind == tsan && ${CUCACHE_TSAN_ALL:-0} != 1 ]]; then
  ctest_args=(-E '^(Modes/GraphCapture\.Randomized|preload_e2e)')
  cmake_args+=(-DCUCACHE_TEST_THREADED_ONLY=ON -DCUCACHE_BUILD_TOOLS=OFF
               -DCUCACHE_BUILD_EXAMPLES=OFF -DCUCACHE_BUILD_TORCH_PLUGIN=OFF)
else
  cmake_args+=(-DCUCACHE_TEST_THREADED_ONLY=OFF -DCUCACHE_BUILD_TOOLS=ON
               -DCUCACHE_BUILD_EXAMPLES=ON -DCUCACHE_BUILD_TORCH_PLUGIN=ON)
fi
# The GPU tests are built only where a GPU could run them (without one they would only skip).
if [[ -e /dev/nvidiactl ]]; then
  cmake_args+=(-DCUCACHE_BUILD_GPU_TESTS=ON)
else
  cmake_args+=(-DCUCACHE_BUILD_GPU_TESTS=OFF)
fi

start=$SECONDS
# Benchmarks are not tests (and Google Benchmark is not instrumented): not built here.
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCUCACHE_SANITIZE="$sanitize" \
  -DCUCACHE_BUILD_BENCHMARKS=OFF "${cmake_args[@]}"
cmake --build "$dir" -j"$jobs"
built=$SECONDS
ctest --test-dir "$dir" --output-on-failure -j"$jobs" --repeat until-pass:2 "${ctest_args[@]}" "$@"
echo "cucache: $kind: built in $((built - start)) s, tests ran in $((SECONDS - built)) s" \
     "(ASAN_OPTIONS=$ASAN_OPTIONS TSAN_OPTIONS=$TSAN_OPTIONS CUCACHE_STRESS_SCALE=$CUCACHE_STRESS_SCALE)"
