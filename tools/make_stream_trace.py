#!/usr/bin/env python3
"""Writes an RMM-format CSV trace of a server that uses a new stream per request (issue 22).

    tools/make_stream_trace.py STREAMS [OUT]   (OUT: a file, or stdout when omitted)

Request i runs on stream id i + 1 (never the default stream 0): it allocates three blocks (a
small one, a mid-sized one and a large one, sizes cycling through fixed lists) and frees them on
its stream; `--in-flight` requests (default 4) overlap, so the frees of request i follow the
allocations of request i + in_flight - 1. Deterministic: the same arguments give the same bytes.
Rows: 6 per request (3 allocate, 3 free); 100,000 streams make 600,000 rows, about 30 MB.
"""
import argparse
import sys

SMALL = [4096, 65536, 262144, 1048576]
MID = [2 << 20, 3 << 20, 6 << 20]
LARGE = [12 << 20, 16 << 20, 24 << 20, 40 << 20]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("streams", type=int, help="number of requests, each on its own stream")
    ap.add_argument("out", nargs="?", help="output file (default: stdout)")
    ap.add_argument("--in-flight", type=int, default=4, help="requests that overlap (default 4)")
    args = ap.parse_args()
    if args.streams <= 0:
        ap.error(f"STREAMS must be a positive number of streams, got {args.streams}")
    if args.in_flight <= 0:
        ap.error(f"--in-flight must be positive, got {args.in_flight}")
    out = open(args.out, "w") if args.out else sys.stdout
    out.write("Thread,Time,Action,Pointer,Size,Stream\n")
    tick = 0
    next_ptr = 0x100000000
    in_flight = []  # (stream, [(ptr, size)])

    def row(action, ptr, size, stream):
        nonlocal tick
        tick += 1
        us = tick
        t = f"{us // 3_600_000_000 % 24:02d}:{us // 60_000_000 % 60:02d}:{us // 1_000_000 % 60:02d}.{us % 1_000_000:06d}"
        out.write(f"1,{t},{action},{ptr:#x},{size},{stream:x}\n")

    def finish(req):
        stream, blocks = req
        for ptr, size in blocks:
            row("free", ptr, size, stream)

    for i in range(args.streams):
        stream = i + 1
        blocks = []
        for sizes, k in ((SMALL, i), (MID, i // 4), (LARGE, i // 16)):
            size = sizes[k % len(sizes)]
            row("allocate", next_ptr, size, stream)
            blocks.append((next_ptr, size))
            next_ptr += 1 << 30  # identifiers only; never reused while live
        in_flight.append((stream, blocks))
        if len(in_flight) >= args.in_flight:
            finish(in_flight.pop(0))
    for req in in_flight:
        finish(req)
    if out is not sys.stdout:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
