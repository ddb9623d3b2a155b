#!/usr/bin/env python3
"""Synthetic traces for the host-time break-even of defer_coalescing (decision 0033).

Writes DIR/pNNN.csv.gz for p in 0, 0.20, 0.30, 0.45, 0.60, 0.80, 1.0: 200,000 allocations on one
stream over a working set of 64 live blocks of 24 sizes (512 B to 12 MiB). Each step frees the
newest block (one step in eight: a random one) and allocates either the size just freed
(probability p) or one of the 24. The share of allocations that take the held block back
follows p (cucache-replay --config defer_coalescing:True reports take_back_count): about 4, 21,
29, 42, 55, 73 and 97% in default mode, 1-3 points more in expandable mode.

    tools/defer_break_even_traces.py DIR
"""
import gzip
import os
import random
import sys

SIZES = [512 << k for k in range(15)] + [
    3 << 20, 6 << 20, 12 << 20, 96 << 10, 192 << 10, 384 << 10, 768 << 10, 1536 << 10, 40 << 10]
SHARES = [0.0, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0]


def trace(p: float, steps: int = 200_000, live_blocks: int = 64) -> str:
    rng = random.Random(7)
    rows = ["Thread,Time,Action,Pointer,Size,Stream"]
    next_ptr = 0x10000000

    def row(action: str, ptr: int, size: int) -> None:
        rows.append("1,00:00:00.%06d,%s,0x%x,%d,0" % (len(rows) % 1_000_000, action, ptr, size))

    def new_ptr() -> int:
        nonlocal next_ptr
        next_ptr += 0x1000000
        return next_ptr

    live = []
    for _ in range(live_blocks):
        ptr, size = new_ptr(), rng.choice(SIZES)
        row("allocate", ptr, size)
        live.append((ptr, size))
    for _ in range(steps):
        k = len(live) - 1 if rng.random() < 0.875 else rng.randrange(len(live))
        ptr, size = live.pop(k)
        row("free", ptr, size)
        size = size if rng.random() < p else rng.choice(SIZES)
        ptr = new_ptr()
        row("allocate", ptr, size)
        live.append((ptr, size))
    for ptr, size in live:
        row("free", ptr, size)
    return "\n".join(rows) + "\n"


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    for p in SHARES:
        with gzip.open(os.path.join(out, "p%03d.csv.gz" % round(p * 100)), "wt") as f:
            f.write(trace(p))
    return 0


if __name__ == "__main__":
    sys.exit(main())
