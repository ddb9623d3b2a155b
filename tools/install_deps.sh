#!/usr/bin/env bash
# Installs the Debian packages cucache builds with, when they are missing. The CUDA toolkit
# (nvcc, headers, static cudart) is not a Debian package here: it must already be installed
# (found on PATH or in /usr/local/cuda).
set -euo pipefail

# clang and libclang-rt-dev (compiler-rt: libFuzzer and clang's sanitizer runtimes) build the fuzz
# harnesses; llvm gives llvm-symbolizer, which turns sanitizer reports into file:line stacks. gcc's
# own sanitizer runtimes (libasan, libubsan, libtsan) come with g++. libunwind-dev captures
# allocation call stacks (CUCACHE_CONF=record_backtraces:True). chromium runs headless in the
# timeline_browser tests (they load cucache-replay --timeline pages; skipped without it). doxygen
# builds the API reference (ctest api_reference, warnings as errors).
packages=(cmake g++ make libgtest-dev libbenchmark-dev libfmt-dev nlohmann-json3-dev libcli11-dev
          zlib1g-dev python3 pkg-config clang libclang-rt-dev llvm libunwind-dev chromium doxygen)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "cucache: installing ${missing[*]}" >&2
  sudo_cmd=()
  [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
fi
# matplotlib draws docs/benchmarks.md's charts (tools/charts.py, ctest charts), for the python3
# first on PATH: Debian's package when that is Debian's python3, else from PyPI with its pip.
if ! python3 -c 'import matplotlib' 2>/dev/null; then
  echo "cucache: installing matplotlib for $(command -v python3)" >&2
  if [[ $(command -v python3) == /usr/bin/python3 ]]; then
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
      python3-matplotlib >/dev/null
  else
    python3 -m pip install --quiet matplotlib
  fi
fi
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "cucache: the CUDA toolkit (nvcc, cuda_runtime_api.h, libcudart_static.a) is required;" \
       "install it to /usr/local/cuda" >&2
  exit 1
fi
