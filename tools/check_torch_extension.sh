#!/usr/bin/env bash
# CI without a GPU or an installed torch: compiles and links the torch extension
# (libcucache_torch_hooks.so, src/integrations/torch/torch_allocator.cpp: cucache as a complete
# CUDAAllocator) against the pinned torch wheel's headers and libraries, then checks that it
# exports its two entry points and reports the torch version it was built for.
#
#   tools/check_torch_extension.sh [BUILD_DIR]     (default build-torch-ext)
#
# The wheel (about 530 MB) is downloaded once with pip (--no-deps) into
# ${CUCACHE_CI_CACHE:-~/.cache/cucache-ci}/torch-VERSION; only include/ and the six libraries the
# link needs are unpacked from it. Environment: TORCH_VERSION (default 2.11.0), PYTHON (python3).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$repo/build-torch-ext}
version=${TORCH_VERSION:-2.11.0}
py=${PYTHON:-python3}
cache=${CUCACHE_CI_CACHE:-$HOME/.cache/cucache-ci}/torch-$version
torch_dir=$cache/torch
libs=(libc10.so libc10_cuda.so libtorch_cuda.so libtorch_cpu.so libtorch.so libtorch_python.so)

if [ ! -f "$torch_dir/lib/libtorch_cuda.so" ] || [ ! -d "$torch_dir/include/c10" ]; then
  mkdir -p "$cache/wheel"
  wheel=$(ls "$cache"/wheel/torch-"$version"-*.whl 2>/dev/null | head -1 || true)
  if [ -z "$wheel" ]; then
    echo "$0: downloading torch==$version (no deps) into $cache/wheel"
    "$py" -m pip download --no-deps --only-binary=:all: --dest "$cache/wheel" "torch==$version" >&2
    wheel=$(ls "$cache"/wheel/torch-"$version"-*.whl | head -1)
  fi
  members=("torch/include/*")
  for l in "${libs[@]}"; do members+=("torch/lib/$l"); done
  rm -rf "$torch_dir"
  (cd "$cache" && unzip -q -o "$wheel" "${members[@]}")
fi

export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$repo}
launcher=()
if command -v ccache >/dev/null; then
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
fi
cmake -S "$repo" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCUCACHE_TORCH_DIR="$torch_dir" \
  "${launcher[@]}" >/dev/null
cmake --build "$build" -j"$(nproc)" --target cucache_torch_hooks

lib=$build/lib/libcucache_torch_hooks.so
for sym in cucache_torch_hooks_install cucache_torch_hooks_torch_version; do
  nm -D --defined-only "$lib" | grep " T $sym\$" >/dev/null || { echo "$0: $lib does not export $sym" >&2; exit 1; }
done
# Every symbol the extension needs is in torch's libraries or the plug-in (checked by the linker
# for the extension itself; libtorch_cuda's own dependencies are not unpacked).
undefined=$(LD_LIBRARY_PATH="$torch_dir/lib:$build/lib" ldd -r "$lib" 2>&1 |
  grep "undefined symbol" | grep "($lib)" || true)
[ -z "$undefined" ] || { echo "$0: unresolved in $lib:"$'\n'"$undefined" >&2; exit 1; }
strings "$lib" | grep -x "$version" >/dev/null || { echo "$0: $lib does not say torch $version" >&2; exit 1; }
echo "$0: libcucache_torch_hooks.so builds and links against torch $version"
