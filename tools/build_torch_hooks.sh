#!/usr/bin/env bash
# Builds libcucache_torch_hooks.so (src/integrations/torch/torch_allocator.cpp) against the torch of
# `python3` with a single g++ command, beside an already built libcucache_torch.so: for machines
# where CMake did not find torch (torch present there but not where cucache was configured). The
# plug-in itself needs no torch and is built by CMake as usual.
#
#   tools/build_torch_hooks.sh [LIB_DIR]     (default: build/lib, where libcucache_torch.so is)
#
# Environment: PYTHON (default python3), CXX (default g++), CUDA_HOME.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
lib_dir=${1:-$repo/build/lib}
cxx=${CXX:-g++}

[ -f "$lib_dir/libcucache_torch.so" ] || { echo "$0: $lib_dir/libcucache_torch.so missing (build it first)" >&2; exit 1; }
# shellcheck source=tools/torch_build_env.sh
source "$repo/tools/torch_build_env.sh"
torch_build_env include/torch/csrc/cuda/CUDAPluggableAllocator.h lib/libtorch_cuda.so

set -x
"$cxx" -std=c++20 -O2 -fPIC -shared -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -I"$repo/src/integrations/torch" -isystem "$torch_dir/include" "${cuda_flags[@]}" \
  "$repo/src/integrations/torch/torch_allocator.cpp" -o "$lib_dir/libcucache_torch_hooks.so" \
  -L"$lib_dir" -lcucache_torch -L"$torch_dir/lib" -ltorch_cuda -lc10_cuda -lc10 \
  -Wl,-rpath,'$ORIGIN' -Wl,-rpath,"$torch_dir/lib"
