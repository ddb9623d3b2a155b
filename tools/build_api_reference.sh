#!/usr/bin/env bash
# Builds the API reference (Doxygen over include/cucache, docs/Doxyfile) into OUT/html; fails on
# any Doxygen warning (WARN_AS_ERROR = FAIL_ON_WARNINGS). Exit 77 (ctest: skipped) without
# doxygen, which tools/install_deps.sh --tests installs.
#
#   tools/build_api_reference.sh [OUT]      # OUT defaults to build/docs/api
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$repo/build/docs/api}")
if ! command -v doxygen >/dev/null; then
  echo "$0: skipped: no doxygen (Debian package doxygen; tools/install_deps.sh --tests installs it)" >&2
  exit 77
fi
mkdir -p "$out"
cd "$repo"
CUCACHE_DOXYGEN_OUT="$out" doxygen docs/Doxyfile
echo "$0: API reference in $out/html/index.html"
