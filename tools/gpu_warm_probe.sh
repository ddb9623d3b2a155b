#!/usr/bin/env bash
# Issue 34's check of the warm pass beside c10: llama1b_train and gpt2_train_dynseq replayed cold
# and warm in expandable mode (CONF) in four arrangements per round -- the two traces alone, each
# with the c10 peer, the seven bundled traces alone, the seven with c10 -- so that a slowdown due
# to the peer, or to the traces replayed before in the same process, shows against the others.
#   tools/gpu_warm_probe.sh BIN_DIR        (BIN_DIR: cucache-replay; the c10 peer is built there)
# Environment: ROUNDS (default 3), CONF (default expandable_segments:True). Exit status 0 only if
# every replay exited 0.
set -uo pipefail
bin=${1:?bin dir}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
rounds=${ROUNDS:-3}
conf=${CONF:-expandable_segments:True}
[[ -f $bin/libcucache_c10_peer.so ]] || bash "$repo/tools/build_c10_peer.sh" "$bin" > /dev/null
llama=$repo/traces/llama1b_train.csv.gz
dynseq=$repo/traces/gpt2_train_dynseq.csv.gz
all=("$repo"/traces/*.csv.gz)
show() {  # label: prints the two traces' lines of the JSON on stdin
  python3 -c '
import json, sys
for l in sys.stdin:
    if not l.startswith("{"):
        continue
    d = json.loads(l)
    if d["trace"] not in ("llama1b_train", "gpt2_train_dynseq"):
        continue
    p = d.get("peers", {}).get("c10", {})
    c10 = ""
    if p:
        c10 = " | c10 cold %.0f warm %.0f" % (p["host_ns_per_op"], p["warm"]["host_ns_per_op"])
    print("  %-12s %s: cucache cold %.0f warm %.0f (warm VM calls %d)%s" % (
        sys.argv[1], d["trace"], d["host_ns_per_op"], d["warm"]["host_ns_per_op"],
        d["warm"]["vm_calls"]["total"], c10))
' "$1"
}
replay() { "$bin/cucache-replay" --backend cuda --json --warm --config "$conf" "$@" 2> /dev/null; }
status=0  # (pipefail: a pipeline fails when its replay does)
for ((r = 1; r <= rounds; r++)); do
  echo "round $r"
  replay --peers none "$llama" "$dynseq" | show "two alone" || status=1
  replay --peers c10 "$llama" | show "one + c10" || status=1
  replay --peers c10 "$dynseq" | show "one + c10" || status=1
  replay --peers none "${all[@]}" | show "seven alone" || status=1
  replay --peers c10 "${all[@]}" | show "seven + c10" || status=1
done
exit $status
