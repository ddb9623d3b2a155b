#!/usr/bin/env bash
# Compiles the library -- the five layer libraries, nothing else -- with clang's thread-safety
# analysis as errors (docs/testing.md, job "tsa"; docs/decisions/0018-thread-safety-annotations.md
# says what is annotated and where the analysis is switched off). Used by .ci/run; the same command
# works by hand:
#
#   bash tools/check_thread_safety.sh          # build-tsa/
#
# -Wthread-safety is the stable set (locks held where REQUIRES / GUARDED_BY ask, released on
# every path, lock order where ACQUIRED_AFTER is given). -Wthread-safety-beta is left out: its
# checks change between clang releases and would make the job depend on the compiler's version.
# CUCACHE_TSA_BUILD_DIR overrides the folder.
set -euo pipefail
cd "$(dirname "$0")/.."

dir=${CUCACHE_TSA_BUILD_DIR:-build-tsa}
launcher=()
if command -v ccache > /dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
fi
CC=clang CXX=clang++ cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Debug "${launcher[@]}" \
  -DCMAKE_CXX_FLAGS="-Wthread-safety -Werror" \
  -DCUCACHE_BUILD_TESTS=OFF -DCUCACHE_BUILD_BENCHMARKS=OFF -DCUCACHE_BUILD_EXAMPLES=OFF \
  -DCUCACHE_BUILD_TOOLS=OFF -DCUCACHE_BUILD_TORCH_PLUGIN=OFF -DCUCACHE_BUILD_PRELOAD=OFF
cmake --build "$dir" -j"${CUCACHE_TSA_JOBS:-$(nproc)}" --target cucache_backend cucache_core \
  cucache_allocator cucache_observe cucache_api
