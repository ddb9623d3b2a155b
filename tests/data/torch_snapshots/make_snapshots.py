#!/usr/bin/env python3
"""Writes the synthetic PyTorch memory snapshots of tests/data/torch_snapshots with python3's own
pickle module, in the schema torch.cuda.memory._snapshot() returns (the fields PyTorch 2.11
writes; docs/replay.md, "PyTorch memory snapshots"). snapshot_reader_test and replay_snapshot_test
hold exact expectations on each; rerun this after changing one (python3 make_snapshots.py).

  basic_p{2,4,5}.pickle  one device, the whole history: allocs on two streams, frees with their
                         completions (one late: record_stream), an oom, segment and snapshot entries
  basic_p4.pickle.gz     the same, gzip'd
  wrapped.pickle         a history whose first entries were dropped (max_entries): a free of a
                         block allocated before it, a completion of a free requested before it,
                         and a block active at the dump that the history never saw
  two_devices.pickle     histories on devices 0 and 1
  no_history.pickle      segments only (dumped without _record_memory_history)
"""
import gzip
import os
import pickle

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
BASE = 0x7F0000000000
S7 = 0x55AA00  # a side stream (PyTorch writes the cudaStream_t as an int)

# Frames shared between entries, as PyTorch shares them (one dict object, memoized once).
F_MODEL = {"filename": "model.py", "line": 42, "name": "forward"}
F_TRAIN = {"filename": "train.py", "line": 7, "name": "step"}


def entry(action, addr, size, stream=0, t=0, frames=None):
    e = {"action": action, "addr": addr, "size": size, "stream": stream,
         "time_us": 1_700_000_000_000_000 + t, "frames": frames if frames is not None else []}
    return e


def block(address, size, requested, state, frames=()):
    return {"address": address, "size": size, "requested_size": requested, "state": state,
            "frames": list(frames)}


def segment(address, total, stream, blocks, device=0):
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    active = sum(b["size"] for b in blocks if b["state"] != "inactive")
    requested = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": device, "address": address, "total_size": total,
            "allocated_size": allocated, "active_size": active, "requested_size": requested,
            "stream": stream, "segment_type": "small" if total <= 2 * MiB else "large",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks}


def basic():
    A, B, C, E = BASE, BASE + 1024, BASE, BASE + 1024
    D = BASE + 0x200000
    stack = [F_MODEL, F_TRAIN]
    trace = [
        entry("segment_alloc", BASE, 2 * MiB, t=0),
        entry("alloc", A, 1000, t=1, frames=stack),
        entry("alloc", B, 3000, t=2, frames=stack),
        entry("free_requested", A, 1000, t=3),
        entry("free_completed", A, 1000, t=3),
        entry("alloc", C, 500, t=4, frames=[F_TRAIN]),
        entry("segment_alloc", D, 20 * MiB, stream=S7, t=5),
        entry("alloc", D, 4 * MiB, stream=S7, t=5, frames=stack),
        entry("free_requested", B, 3000, t=6),
        entry("free_completed", B, 3000, t=6),
        entry("free_requested", D, 4 * MiB, stream=S7, t=7),
        entry("alloc", E, 100, t=8, frames=stack),
        entry("free_completed", D, 4 * MiB, stream=S7, t=9),  # late: record_stream
        {"action": "oom", "device_free": 123, "size": 1 << 40, "stream": 0,
         "time_us": 1_700_000_000_000_010, "frames": []},
        entry("snapshot", 0, 0, t=11),
    ]
    segments = [
        segment(BASE, 2 * MiB, 0, [block(C, 512, 500, "active_allocated", [F_TRAIN]),
                                   block(E, 512, 100, "active_allocated", stack),
                                   block(BASE + 2048, 2 * MiB - 2048, 0, "inactive")]),
        segment(D, 20 * MiB, S7, [block(D, 20 * MiB, 0, "inactive")]),
    ]
    return {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": None, "max_split_size": -1}}


def wrapped():
    P, Q, X = BASE + 0x100000, BASE + 0x300000, BASE + 0x100000
    R, S = BASE + 0x400000, BASE + 0x402000
    trace = [
        entry("free_requested", P, 2048, t=1),   # allocated before the history
        entry("free_completed", P, 2048, t=1),
        entry("free_completed", Q, 4096, t=2),   # requested before the history
        entry("alloc", X, 4096, t=3, frames=[F_MODEL]),
    ]
    segments = [
        segment(BASE, 20 * MiB, 0, [
            block(BASE, 0x100000, 0, "inactive"),
            block(X, 4096, 4096, "active_allocated", [F_MODEL]),
            block(X + 4096, 0x300000 - 4096, 0, "inactive"),
            block(R, 8192, 8192, "active_allocated", [F_TRAIN]),  # never in the history
            block(S, 1024, 1000, "active_pending_free"),
            block(S + 1024, 20 * MiB - 0x402400, 0, "inactive"),
        ]),
    ]
    return {"segments": segments, "device_traces": [trace]}


def two_devices():
    d0 = [entry("alloc", BASE, 1000, t=1), entry("free_requested", BASE, 1000, t=2)]
    d1 = [entry("alloc", BASE + 0x1000000, 5000, t=1), entry("alloc", BASE + 0x1002000, 7000, t=2)]
    return {"segments": [], "device_traces": [d0, d1]}


def no_history():
    return {"segments": basic()["segments"], "device_traces": [[]]}


def write(name, value, protocol=4, gz=False):
    data = pickle.dumps(value, protocol=protocol)
    path = os.path.join(HERE, name)
    if gz:
        with gzip.GzipFile(path, "wb", mtime=0) as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)


if __name__ == "__main__":
    for p in (2, 4, 5):
        write(f"basic_p{p}.pickle", basic(), protocol=p)
    write("basic_p4.pickle.gz", basic(), protocol=4, gz=True)
    write("wrapped.pickle", wrapped())
    write("two_devices.pickle", two_devices())
    write("no_history.pickle", no_history())
