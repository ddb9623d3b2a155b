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
py=${PYTHON:-python3}
cxx=${CXX:-g++}

mapfile -t info < <("$py" -c 'import os, site, torch
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)')
torch_dir=${info[0]}
abi=${info[1]}
for f in include/c10/cuda/CUDACachingAllocator.h lib/libc10_cuda.so; do
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

mkdir -p "$out_dir"
set -x
"$cxx" -std=c++20 -O2 -fPIC -shared -D_GLIBCXX_USE_CXX11_ABI="$abi" \
  -I"$repo/bench/peers" -isystem "$torch_dir/include" "${cuda_flags[@]}" \
  "$repo/bench/peers/c10_peer.cpp" -o "$out_dir/libcucache_c10_peer.so" \
  -L"$torch_dir/lib" -lc10_cuda -lc10 -Wl,-rpath,"$torch_dir/lib"
