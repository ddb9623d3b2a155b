#!/usr/bin/env bash
# cucache::memory_resource through cuda::mr::any_resource, which the CUDA 13.0 toolkit's CCCL
# (3.0.1) does not have: builds memory_resource_test against a newer CCCL's headers from PyPI's
# nvidia-cuda-cccl wheel (headers only; nothing of it is committed or installed) and requires the
# any_resource test to run and pass, not skip.
#   tools/check_cccl_any_resource.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-cccl}
version=13.3.5.0.6  # CCCL 3.5.0
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --no-deps -q "nvidia-cuda-cccl==$version" -d "$work"
python3 -m zipfile -e "$work"/nvidia_cuda_cccl-*.whl "$work/x"
inc=$(dirname "$(dirname "$(find "$work/x" -path '*cccl/cuda/memory_resource' -print -quit)")")
[[ -f $inc/cuda/__memory_resource/any_resource.h ]] || { echo "no any_resource.h in $inc" >&2; exit 1; }
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCUCACHE_CCCL_INCLUDE_DIR="$inc" > /dev/null
cmake --build "$build" -j"$(nproc)" --target memory_resource_test
out=$(CUCACHE_BACKEND=sim "$build/bin/memory_resource_test" 2>&1) || { echo "$out"; exit 1; }
echo "$out" | tail -3
grep -q '^\[       OK \] MemoryResource.ThroughAnyResource' <<<"$out" ||
  { echo "MemoryResource.ThroughAnyResource did not run" >&2; exit 1; }
echo "check_cccl_any_resource: ok ($(grep -m1 -o 'CCCL_VERSION [0-9]*' -r "$inc/cuda/std/__cccl/version.h"))"
