#!/usr/bin/env bash
# Replays every trace of a directory (*.csv, *.csv.gz) through cucache-replay in one run with
# --json, writing the JSON Lines to a file; arguments after `--` go to the replay as they are.
#
#   tools/replay_all.sh [DIR [OUT]] [-- REPLAY_ARGS...]
#
# DIR defaults to traces/ of this repository (the seven bundled traces), OUT to
# replay_results.jsonl.
# The binary is $CUCACHE_REPLAY, or build/bin/cucache-replay of this repository.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir="$repo/traces"
out="replay_results.jsonl"
positional=0
while [ $# -gt 0 ]; do
  if [ "$1" = "--" ]; then shift; break; fi
  case $positional in
    0) dir=$1 ;;
    1) out=$1 ;;
    *) echo "usage: $0 [DIR [OUT]] [-- REPLAY_ARGS...]" >&2; exit 2 ;;
  esac
  positional=$((positional + 1))
  shift
done
replay=${CUCACHE_REPLAY:-$repo/build/bin/cucache-replay}
if [ ! -x "$replay" ]; then
  echo "$0: no replay binary at $replay (build it, or set CUCACHE_REPLAY)" >&2
  exit 1
fi

shopt -s nullglob
traces=("$dir"/*.csv "$dir"/*.csv.gz)
if [ ${#traces[@]} -eq 0 ]; then
  echo "$0: no traces (*.csv, *.csv.gz) in $dir" >&2
  exit 1
fi
# Write to a temporary file first so a failed run never leaves half a result under OUT's name.
tmp="$out.partial"
"$replay" --json "$@" "${traces[@]}" >"$tmp"
mv "$tmp" "$out"
echo "$0: ${#traces[@]} traces -> $out" >&2
