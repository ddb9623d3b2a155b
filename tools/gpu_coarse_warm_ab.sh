#!/usr/bin/env bash
# Issue 34's "warm pass no slower" with coarse handles: the warm pass of traces replayed in
# expandable mode with coarse_handles at its default (8) and off (0), the two settings
# alternating round by round (which goes first alternates too), alone and beside the c10 peer.
#   tools/gpu_coarse_warm_ab.sh BIN_DIR [TRACE...]   (default: llama1b_train gpt2_generate)
# Environment: ROUNDS (default 6); BACKEND (default cuda; sim for a dry run of the script here,
# without the peer). Prints one line per trace, setting and arrangement per round; exit status 0
# only if every replay exited 0.
set -uo pipefail
bin=${1:?bin dir}; shift
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${ROUNDS:-6}
backend=${BACKEND:-cuda}
arrangements=(none c10)
[[ $backend == sim ]] && arrangements=(none)
traces=("$@")
[[ ${#traces[@]} -eq 0 ]] && traces=("$repo/traces/llama1b_train.csv.gz" "$repo/traces/gpt2_generate.csv.gz")
if [[ $backend != sim && ! -f $bin/libcucache_c10_peer.so ]]; then
  bash "$repo/tools/build_c10_peer.sh" "$bin" > /dev/null
fi
show() {
  python3 -c '
import json, sys
for l in sys.stdin:
    if not l.startswith("{"):
        continue
    d = json.loads(l)
    p = d.get("peers", {}).get("c10", {})
    c10 = " c10 warm %.0f" % p["warm"]["host_ns_per_op"] if p else ""
    print("%-6s %-10s %-16s cold %5.0f warm %5.0f (warm VM calls %d)%s" % (
        sys.argv[1], sys.argv[2], d["trace"], d["host_ns_per_op"], d["warm"]["host_ns_per_op"],
        d["warm"]["vm_calls"]["total"], c10))
' "$@"
}
status=0
for ((r = 1; r <= rounds; r++)); do
  order=("8" "0")
  (( r % 2 == 0 )) && order=("0" "8")
  for ch in "${order[@]}"; do
    conf="expandable_segments:True,coarse_handles:$ch"
    for peers in "${arrangements[@]}"; do
      "$bin/cucache-replay" --backend "$backend" --json --warm --config "$conf" --peers "$peers" \
        "${traces[@]}" 2> /dev/null | show "r$r" "coarse:$ch" | sed "s/\$/ [$peers]/" || {
        status=1
        echo "r$r coarse:$ch [$peers]: the replay failed" >&2
      }
    done
  done
done
exit $status
