#!/usr/bin/env bash
# Builds libcucache_c10_peer.so, the shim that lets cucache-replay compare against PyTorch's CUDA
# caching allocator, against the torch of `python3` with a single g++ command: for machines where
# CMake did not build it (torch present there but not where the replay was configured).
#
#   tools/build_c10_peer.sh [OUT_DIR]     (default: build/bin, beside cucache-replay)
#
# Environment: PYTHON (default python3), CXX (default g++), CUDA_HOME.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out_dir=${1:-$repo/build/bin}
cxx=${CXX:-g++}

# shellcheck source=tools/torch_build_env.sh
source "$repo/tools/torch_build_env.sh"
torch_build_env include/c10/cuda/CUDACachingAllocator.h lib/libc10_cuda.so

mkdir -p "$out_dir"
set -x
"$cxx" -std=c++20 -O2 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -isystem "$torch_dir/include" "${cuda_flags[@]}" \
  "$repo/tools/common/c10_peer.cpp" -o "$out_dir/libcucache_c10_peer.so" \
  -L"$torch_dir/lib" -lc10_cuda -lc10 -Wl,-rpath,"$torch_dir/lib"
