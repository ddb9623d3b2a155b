"""Checks python/cucache_torch.py's ctypes layer against libcucache_torch.so on the simulated device
(CUCACHE_BACKEND=sim, set by ctest): the struct layout, the stats keys and values, the text
buffers. Needs no torch: it calls the plug-in's alloc/free itself, as torch would."""

import ctypes
import json
import sys

import cucache_torch as ct
from cucache import _lib as layout  # the ctypes struct and its check against the library

lib = ct.library()
assert lib.cucache_torch_backend_name() == b"sim", lib.cucache_torch_backend_name()
# The ctypes layout is the plug-in's field table, field for field: names, order, offsets, sizes,
# types, and the struct's size (library() refuses a mismatch too; this names the difference).
mine, theirs = layout.stats_layout(), layout.library_stats_layout(lib)
assert [f[0] for f in mine] == [f[0] for f in theirs], (mine, theirs)
assert mine == theirs, [(a, b) for a, b in zip(mine, theirs) if a != b]
assert lib.cucache_torch_stats_size() == ctypes.sizeof(layout._Stats) == theirs[-1][1] + theirs[-1][2]
assert layout.layout_mismatch(lib) == ""
# ... and the check has teeth: a library whose table lists two fields the other way round, or
# one field more, is refused.
class _Drifted:
    def __init__(self, rows, size):
        self._text = "".join(f"{n} {o} {z} {k}\n" for n, o, z, k in rows).encode()
        self._size = size

    def cucache_torch_stats_layout(self):
        return self._text

    def cucache_torch_stats_size(self):
        return self._size


swapped = list(theirs)
swapped[9], swapped[10] = (swapped[10][0],) + swapped[9][1:], (swapped[9][0],) + swapped[10][1:]
assert "field 9" in layout.layout_mismatch(_Drifted(swapped, ctypes.sizeof(layout._Stats)))
extra = theirs + [("new_counter", theirs[-1][1] + 8, 8, "u64")]
assert layout.layout_mismatch(_Drifted(extra, ctypes.sizeof(layout._Stats) + 8)) != ""
assert "field" in layout.layout_mismatch(_Drifted(extra, ctypes.sizeof(layout._Stats)))
# Every field reaches memory_stats() under its key.
keys = set(ct.memory_stats(0))
for name, _, _, kind in theirs:
    if kind == "stat[3]":
        assert f"{name}.all.peak" in keys and f"{name}.large_pool.freed" in keys, name
    elif name.startswith("fragmentation_"):
        assert name.replace("_", ".", 1) in keys, name
    else:
        assert name in keys, name
p = lib.cucache_torch_alloc(3 << 20, 0, None)
q = lib.cucache_torch_alloc(1000, 0, None)
assert p and q, ct.last_error()
s = ct.memory_stats(0)
assert s["allocated_bytes.all.current"] == (3 << 20) + 1024, s["allocated_bytes.all.current"]
assert s["allocated_bytes.large_pool.current"] == 3 << 20
assert s["allocated_bytes.small_pool.current"] == 1024
assert s["reserved_bytes.all.peak"] == 22 << 20, s["reserved_bytes.all.peak"]
assert s["requested_bytes.all.current"] == (3 << 20) + 1000
assert s["segment.all.current"] == 2 and s["num_device_alloc"] == 2
assert abs(s["fragmentation.overhead"] - (1 - ((3 << 20) + 1024) / (22 << 20))) < 1e-12
assert "fragmentation.external" in s and "largest_free_block" in s
summary = ct.memory_summary(0)
assert "Reserved memory" in summary and "Allocated memory" in summary, summary
snap = json.loads(ct.snapshot_json(0))
live = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "allocated"]
assert sorted(b["address"] for b in live) == sorted([p, q]), live
lib.cucache_torch_free(ctypes.c_void_p(p), 3 << 20, 0, None)
lib.cucache_torch_free(ctypes.c_void_p(q), 1000, 0, None)
ct.empty_cache()
ct.reset_peak_memory_stats(0)
s = ct.memory_stats(0)
assert s["reserved_bytes.all.current"] == 0 and s["reserved_bytes.all.peak"] == 0, s
before = ct.bad_free_count()
lib.cucache_torch_free(ctypes.c_void_p(0x5000), 16, 0, None)
assert ct.bad_free_count() == before + 1
assert "0x5000" in ct.last_error(), ct.last_error()
print("torch_module_check: ok")
sys.exit(0)
