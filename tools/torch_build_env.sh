# Sourced by tools/build_c10_peer.sh and tools/build_torch_hooks.sh, which build a library against
# the torch of $PYTHON with one g++ command: finds that torch and the CUDA runtime headers its
# c10 headers include.
#
#   torch_build_env FILE...   FILE: paths under the torch package that must exist
#
# Sets torch_dir (the torch package), abi (its _GLIBCXX_USE_CXX11_ABI), torch_version and
# cuda_flags (-isystem options: $CUDA_HOME/include, /usr/local/cuda/include, else the nvidia-*
# wheels torch depends on). Exits with a message naming what is missing. Environment: PYTHON
# (default python3), CUDA_HOME.
torch_build_env() {
  local py=${PYTHON:-python3}
  local info
  mapfile -t info < <("$py" -c 'import os, torch
print(os.path.dirname(torch.__file__))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(torch.__version__)')
  if [ ${#info[@]} -lt 3 ]; then
    echo "$0: '$py -c \"import torch\"' failed: no torch there (set PYTHON)" >&2
    exit 1
  fi
  torch_dir=${info[0]}
  abi=${info[1]}
  torch_version=${info[2]}
  local f
  for f in "$@"; do
    [ -e "$torch_dir/$f" ] || { echo "$0: $torch_dir/$f missing (torch without CUDA or headers?)" >&2; exit 1; }
  done
  cuda_flags=()
  local d
  for d in "${CUDA_HOME:-/nonexistent}/include" /usr/local/cuda/include; do
    if [ -f "$d/cuda_runtime_api.h" ]; then cuda_flags+=(-isystem "$d"); break; fi
  done
  if [ ${#cuda_flags[@]} -eq 0 ]; then
    local header
    while IFS= read -r header; do
      cuda_flags+=(-isystem "$(dirname "$header")")
    done < <(find "$torch_dir/../nvidia" -maxdepth 4 -path '*/include/*' \
               \( -name cuda_runtime_api.h -o -name cuda.h \) 2>/dev/null | sort -u)
  fi
  if [ ${#cuda_flags[@]} -eq 0 ]; then
    echo "$0: no cuda_runtime_api.h (set CUDA_HOME)" >&2
    exit 1
  fi
}
