#!/usr/bin/env bash
# Records the replay figures of the seven shared traces: default, expandable, expandable --fit.
# usage: record_replays.sh REPLAY_BINARY OUTDIR (OUTDIR absolute)
set -euo pipefail
bin=$1; out=$2; mkdir -p "$out"
cd "$(dirname "${BASH_SOURCE[0]}")/../../../.."
t=(traces/*.csv.gz)
"$bin" --backend sim --json "${t[@]}" > "$out/default.jsonl" 2> "$out/default.err"
"$bin" --backend sim --json --config expandable_segments:True "${t[@]}" > "$out/expandable.jsonl" 2> "$out/expandable.err"
"$bin" --backend sim --json --fit --config expandable_segments:True "${t[@]}" > "$out/fit_expandable.jsonl" 2> "$out/fit_expandable.err"
echo ok > "$out/done"
