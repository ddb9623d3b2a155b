"""Checks python/cucache_torch.py's ctypes layer against libcucache_torch.so on the simulated device
(CUCACHE_BACKEND=sim, set by ctest): the struct layout, the stats keys and values, the text
buffers. Needs no torch: it calls the plug-in's alloc/free itself, as torch would."""

import ctypes
import json
import sys

import cucache_torch as ct

lib = ct.library()
assert lib.cucache_torch_backend_name() == b"sim", lib.cucache_torch_backend_name()
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
