#!/usr/bin/env bash
# Installs the Debian packages cucache builds with, when they are missing. The CUDA toolkit
# (nvcc, headers, static cudart) is not a Debian package here: it must already be installed
# (found on PATH or in /usr/local/cuda).
#
#   tools/install_deps.sh           what configuring and building need (README's main command):
#                                   about 50 MB installed (CMake is most of it), plus g++ if the
#                                   machine lacks it
#   tools/install_deps.sh --tests   also what some tests and CI jobs use (README's test command):
#                                   about 600 MB more (chromium 290 MB, clang/LLVM 230 MB, doxygen,
#                                   matplotlib, prometheus_client). Without them those
#                                   tests skip with a one-line reason: timeline_browser_* (chromium),
#                                   api_reference (doxygen), charts (matplotlib), python_metrics
#                                   (prometheus_client); the fuzz job falls back to its standalone
#                                   driver (clang, libclang-rt-dev)
set -euo pipefail

tests=0
for arg in "$@"; do
  case $arg in
    --tests) tests=1 ;;
    -h | --help)
      sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *)
      echo "tools/install_deps.sh: unknown argument '$arg' (accepted: --tests)" >&2
      exit 2
      ;;
  esac
done

# The build: compilers, CMake, the libraries cucache and its tools, tests and benchmarks link or
# include (the tests and benchmarks are configured with the project, so GoogleTest and Google
# Benchmark are needed to configure it even when only cucache-replay is built). libunwind-dev
# captures allocation call stacks (CUCACHE_CONF=record_backtraces:True).
packages=(cmake g++ make libgtest-dev libbenchmark-dev libfmt-dev nlohmann-json3-dev libcli11-dev
          zlib1g-dev python3 pkg-config libunwind-dev)
# --tests: clang and libclang-rt-dev (compiler-rt: libFuzzer and clang's sanitizer runtimes) build
# the fuzz harnesses; llvm gives llvm-symbolizer, which turns sanitizer reports into file:line
# stacks (gcc's own sanitizer runtimes come with g++). chromium runs headless in the
# timeline_browser tests (they load cucache-replay --timeline pages). doxygen builds the API
# reference (ctest api_reference, warnings as errors). matplotlib: below.
if ((tests)); then
  packages+=(clang libclang-rt-dev llvm chromium doxygen)
fi
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
# --tests: matplotlib draws docs/benchmarks.md's charts (tools/charts.py, ctest charts), for the
# python3 first on PATH: Debian's package when that is Debian's python3, else from PyPI with its pip.
if ((tests)) && ! python3 -c 'import matplotlib' 2>/dev/null; then
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
# --tests: prometheus_client parses the metrics in ctest python_metrics (skipped without it), for
# the python3 first on PATH, as matplotlib.
if ((tests)) && ! python3 -c 'import prometheus_client' 2>/dev/null; then
  echo "cucache: installing prometheus_client for $(command -v python3)" >&2
  if [[ $(command -v python3) == /usr/bin/python3 ]]; then
    sudo_cmd=()
    [[ $(id -u) -ne 0 ]] && sudo_cmd=(sudo)
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends \
      python3-prometheus-client >/dev/null
  else
    python3 -m pip install --quiet prometheus-client
  fi
fi
if ! command -v nvcc >/dev/null && [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "cucache: the CUDA toolkit (nvcc, cuda_runtime_api.h, libcudart_static.a) is required;" \
       "install it to /usr/local/cuda" >&2
  exit 1
fi
