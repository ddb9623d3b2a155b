#!/usr/bin/env bash
# Uses cucache as a downstream project would, and runs the result on the simulated device
# (CUCACHE_BACKEND=sim; the GPU examples skip without a GPU):
#
#   1. installs BUILD_DIR (default: build/, a static build) with `cmake --install`, checks what was
#      installed (public headers only, the package files, cucache.pc, cucache-replay);
#   2. builds examples/ as a separate project with find_package(cucache) against it, with the
#      compiler's default C++ standard (C++17 for GCC 12) and nvcc's for the CUDA examples; and
#      against BUILD_DIR itself (-Dcucache_DIR=BUILD_DIR: the build tree's package);
#   3. builds and links by hand with pkg-config (C99 and C++20 programs, and header checks: cucache.h
#      as C99 and C++11, thrust.hpp as C++14, memory_resource.hpp as C++17), and builds examples/
#      with CUCACHE_EXAMPLES_USE=pkg-config;
#   4. builds examples/ with cucache added by add_subdirectory, as a shared library
#      (BUILD_SHARED_LIBS=ON; tools and plug-in must be off there), checks libcucache.so's SONAME
#      and exported symbols, installs that and builds examples/ against the shared package.
#
# Usage: tools/check_downstream.sh [BUILD_DIR]   (.ci/run calls it after the tests)
set -euo pipefail
src="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$src/build}" && pwd)"
jobs="$(nproc)"
work="$(mktemp -d "${TMPDIR:-/tmp}/cucache-downstream.XXXXXX")"
trap 'rm -rf "$work"' EXIT
export CUCACHE_BACKEND=sim
unset CUCACHE_CONF

step() { printf '\n== check_downstream: %s\n' "$*"; }
fail() {
  echo "check_downstream: FAIL: $*" >&2
  exit 1
}
configure() { cmake "$@" -DCMAKE_BUILD_TYPE=Release >"$work/last.log" 2>&1 || { cat "$work/last.log"; exit 1; }; }
build_and_test() {
  cmake --build "$1" -j"$jobs" >"$work/last.log" 2>&1 || { cat "$work/last.log"; exit 1; }
  ctest --test-dir "$1" --output-on-failure -j"$jobs"
}

step "install $build (static)"
static="$work/static"
cmake --install "$build" --prefix "$static" >/dev/null
for f in include/cucache/cucache.h include/cucache/cucache.hpp include/cucache/memory_resource.hpp \
         include/cucache/thrust.hpp lib/cmake/cucache/cucacheConfig.cmake \
         lib/cmake/cucache/cucacheConfigVersion.cmake lib/cmake/cucache/cucacheTargets.cmake \
         lib/pkgconfig/cucache.pc lib/libcucache_api.a lib/libcucache_backend.a bin/cucache-replay \
         lib/libcucache_preload.so; do
  [[ -e "$static/$f" ]] || fail "$f is not installed"
done
# Exactly the public headers: nothing from src/, and every header of include/cucache.
diff <(cd "$src/include" && find . -type f | sort) <(cd "$static/include" && find . -type f | sort) \
  || fail "the installed headers differ from include/"
"$static/bin/cucache-replay" --help >/dev/null || fail "the installed cucache-replay does not run"

step "examples/ with find_package(cucache), static"
configure -S "$src/examples" -B "$work/ex-package" -DCMAKE_PREFIX_PATH="$static"
grep -q "shared: OFF" "$work/last.log" || fail "find_package did not report the static package"
build_and_test "$work/ex-package"

step "examples/ with find_package(cucache) from the build tree (cucache_DIR=$build)"
# docs/api.md: the build tree is a package too, without installing it.
configure -S "$src/examples" -B "$work/ex-buildtree" -Dcucache_DIR="$build" -DCUCACHE_EXAMPLES_CUDA=OFF
grep -q "from $build" "$work/last.log" || fail "find_package did not use the build tree $build"
build_and_test "$work/ex-buildtree"

step "pkg-config, by hand"
export PKG_CONFIG_PATH="$static/lib/pkgconfig"
[[ "$(pkg-config --modversion cucache)" == "$(sed -n 's/^project(cucache VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")" ]] \
  || fail "cucache.pc's version is not the project's"
cflags="$(pkg-config --cflags cucache)"
libs="$(pkg-config --libs cucache)"
cccl="$(pkg-config --variable=cccl_includedir cucache)"
cc=(cc) cxx=(c++)
# shellcheck disable=SC2086
{
  "${cc[@]}" -std=c99 -Wall -Wextra -Werror $cflags -c "$src/examples/c_api.c" -o "$work/c_api.o"
  "${cc[@]}" "$work/c_api.o" $libs -o "$work/c_api"  # a C driver links: the .pc names libstdc++
  "${cxx[@]}" -std=c++20 -Wall -Wextra -Werror $cflags "$src/examples/cpp_api.cpp" $libs -o "$work/cpp_api"
  "${cxx[@]}" -std=c++20 -Wall -Wextra -Werror $cflags -isystem "$cccl" \
    "$src/examples/memory_resource.cpp" $libs -o "$work/memory_resource"
  for std in c++11 c++14 c++17 c++20; do
    echo '#include <cucache/cucache.h>' | "${cxx[@]}" -std=$std -Wall -Wextra -Werror $cflags -fsyntax-only -x c++ -
  done
  echo '#include <cucache/cucache.h>' | "${cc[@]}" -std=c99 -Wall -Wextra -Werror $cflags -fsyntax-only -x c -
  echo '#include <cucache/thrust.hpp>' | "${cxx[@]}" -std=c++14 -Wall -Wextra -Werror $cflags -fsyntax-only -x c++ -
  echo '#include <cucache/memory_resource.hpp>' \
    | "${cxx[@]}" -std=c++17 -Wall -Wextra -Werror $cflags -isystem "$cccl" -fsyntax-only -x c++ -
}
for exe in c_api cpp_api memory_resource; do
  "$work/$exe" >"$work/$exe.out" || { cat "$work/$exe.out"; fail "$exe (pkg-config) failed"; }
done
echo "pkg-config: c_api, cpp_api, memory_resource built and ran; header checks passed"

step "examples/ with pkg-config"
configure -S "$src/examples" -B "$work/ex-pkgconfig" -DCUCACHE_EXAMPLES_USE=pkg-config \
  -DCUCACHE_EXAMPLES_CUDA=OFF
build_and_test "$work/ex-pkgconfig"

step "examples/ with add_subdirectory(cucache), BUILD_SHARED_LIBS=ON"
# -O1: a quicker compile of the library than Release's -O3. Tools and plug-in must default off.
configure -S "$src/examples" -B "$work/ex-subdir" -DCUCACHE_EXAMPLES_USE=subdirectory \
  -DBUILD_SHARED_LIBS=ON -DCUCACHE_EXAMPLES_CUDA=OFF -DCMAKE_CXX_FLAGS_RELEASE=-O1
if grep -q "CLI11\|torch" "$work/last.log" || [[ -e "$work/ex-subdir/cucache/tools" ]] \
   || [[ -e "$work/ex-subdir/cucache/src/integrations" ]]; then
  fail "tools or the torch plug-in were configured in a subproject"
fi
build_and_test "$work/ex-subdir"
lib="$(find "$work/ex-subdir" -name 'libcucache.so.*.*.*' -type f | head -n1)"
[[ -n "$lib" ]] || fail "no versioned libcucache.so was built"
soname="$(objdump -p "$lib" | awk '/SONAME/ {print $2}')"
[[ "$soname" =~ ^libcucache\.so\.[0-9]+\.[0-9]+$ ]] || fail "libcucache.so's SONAME is '$soname'"
# Only cucache's own symbols leave the library: no CUDA runtime, no fmt.
exported="$(nm -D --defined-only "$lib" | awk '{print $3}')"
grep -q '^cucacheMalloc$' <<<"$exported" || fail "cucacheMalloc is not exported"
if grep -E '^cuda[A-Z]|^_ZN3fmt|^__cuda' <<<"$exported" | head -n3 | grep -q .; then
  fail "libcucache.so exports CUDA runtime or fmt symbols"
fi
readelf -d "$work/ex-subdir/cpp_api" | grep -q "NEEDED.*$soname" \
  || fail "cpp_api does not link $soname"
echo "shared: $soname, $(wc -l <<<"$exported") exported symbols"

step "install the shared build; examples/ with find_package(cucache), shared"
shared="$work/shared"
cmake --install "$work/ex-subdir" --prefix "$shared" >/dev/null
[[ -e "$shared/lib/$soname" && ! -e "$shared/lib/libcucache_api.a" ]] \
  || fail "the shared install is not libcucache.so alone"
[[ ! -e "$shared/bin/cucache-replay" ]] || fail "a subproject installed cucache-replay"
grep -q -- "-lcucache$" "$shared/lib/pkgconfig/cucache.pc" || fail "the shared cucache.pc does not say -lcucache"
configure -S "$src/examples" -B "$work/ex-shared" -DCMAKE_PREFIX_PATH="$shared" -DCUCACHE_EXAMPLES_CUDA=OFF
grep -q "shared: ON" "$work/last.log" || fail "find_package did not report the shared package"
build_and_test "$work/ex-shared"
readelf -d "$work/ex-shared/cpp_api" | grep -q "NEEDED.*$soname" || fail "cpp_api does not link $soname"

step "ok: find_package (static, shared), pkg-config and add_subdirectory consumers built and ran"
