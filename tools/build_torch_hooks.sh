#!/usr/bin/env bash
# Builds libcucache_torch_hooks.so -- cucache as a complete CUDAAllocator of torch
# (src/integrations/torch/torch_allocator.cpp) -- against the torch of `python3` with a single g++
# command, linking an already built libcucache_torch.so: for machines where CMake did not find
# torch. cucache.torch.install() runs it on first use (into a per-torch-version cache folder).
#
#   tools/build_torch_hooks.sh [LIB_DIR [OUT_DIR]]
#     LIB_DIR: where libcucache_torch.so is (default build/lib); OUT_DIR: where the library goes
#     (default LIB_DIR; elsewhere it gets an rpath to LIB_DIR).
#
# Environment: PYTHON (default python3), CXX (default g++), CUDA_HOME.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lib_dir=$(cd "${1:-$repo/build/lib}" && pwd)
out_dir=${2:-$lib_dir}
cxx=${CXX:-g++}

[ -f "$lib_dir/libcucache_torch.so" ] || { echo "$0: $lib_dir/libcucache_torch.so missing (build it first)" >&2; exit 1; }
command -v "$cxx" >/dev/null || { echo "$0: no C++ compiler '$cxx' (set CXX)" >&2; exit 1; }
# shellcheck source=tools/torch_build_env.sh
source "$repo/tools/torch_build_env.sh"
torch_build_env include/torch/csrc/cuda/CUDAPluggableAllocator.h lib/libtorch_cuda.so
mkdir -p "$out_dir"

set -x
"$cxx" -std=c++20 -O2 -fPIC -shared -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -I"$repo/src/integrations/torch" -isystem "$torch_dir/include" "${cuda_flags[@]}" \
  "$repo/src/integrations/torch/torch_allocator.cpp" -o "$out_dir/libcucache_torch_hooks.so.tmp" \
  -L"$lib_dir" -lcucache_torch -L"$torch_dir/lib" -ltorch_cuda -lc10_cuda -lc10 \
  -Wl,-rpath,'$ORIGIN' -Wl,-rpath,"$lib_dir" -Wl,-rpath,"$torch_dir/lib"
mv "$out_dir/libcucache_torch_hooks.so.tmp" "$out_dir/libcucache_torch_hooks.so"
