#!/usr/bin/env bash
# Builds libcucache_torch_hooks.so (src/integrations/torch/torch_hooks.cpp) against the torch of
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
py=${PYTHON:-python3}
cxx=${CXX:-g++}

[ -f "$lib_dir/libcucache_torch.so" ] || { echo "$0: $lib_dir/libcucache_torch.so missing (build it first)" >&2; exit 1; }
mapfile -t info < <("$py" -c 'import os, torch
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))')
torch_dir=${info[0]}
abi=${info[1]}
for f in include/torch/csrc/cuda/CUDAPluggableAllocator.h lib/libtorch_cuda.so; do
  [ -e "$torch_dir/$f" ] || { echo "$0: $torch_dir/$f missing (torch without CUDA or headers?)" >&2; exit 1; }
done

# The c10 headers include the CUDA runtime's: a toolkit, or the nvidia-* wheels torch depends on.
cuda_flags=()
for d in "${CUDA_HOME:-/nonexistent}/include" /usr/local/cuda/include; do
  if [ -f "$d/cuda_runtime_api.h" ]; then cuda_flags+=(-isystem "$d"); break; fi
done
if [ ${#cuda_flags[@]} -eq 0 ]; then
  while IFS= read -r header; do
    cuda_flags+=(-isystem "$(dirname "$header")")
  done < <(find "$torch_dir/../nvidia" -maxdepth 4 -path '*/include/*' \
             \( -name cuda_runtime_api.h -o -name cuda.h \) 2>/dev/null | sort -u)
fi
if [ ${#cuda_flags[@]} -eq 0 ]; then
  echo "$0: no cuda_runtime_api.h (set CUDA_HOME)" >&2
  exit 1
fi

set -x
"$cxx" -std=c++20 -O2 -fPIC -shared -fvisibility=hidden -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -I"$repo/src/integrations/torch" -isystem "$torch_dir/include" "${cuda_flags[@]}" \
  "$repo/src/integrations/torch/torch_hooks.cpp" -o "$lib_dir/libcucache_torch_hooks.so" \
  -L"$lib_dir" -lcucache_torch -L"$torch_dir/lib" -ltorch_cuda -lc10_cuda -lc10 \
  -Wl,-rpath,'$ORIGIN' -Wl,-rpath,"$torch_dir/lib"
