"""Where sleep and wake spend their time (issue 33): a 9.0 GiB sleepable tag of the issue's shape
(blocks of 3 GiB, 5 GiB, 700 MiB, 300 MiB and small ones) put to sleep and woken three times
dropping contents, then three times keeping them, each call timed with the deltas of cucache's
device-call counters (handles unmapped/released, mapped/created, VM host time, synchronizations).

    CUCACHE_CONF=expandable_segments:True python bench/torch/sleep_breakdown.py [--prepare]

--prepare calls cucache.prepare_sleep("w") (timed apart) after the dropped-contents cycles -- a
dropped sleep frees the tag's pinned buffer -- so that the first kept sleep finds its host buffer
pinned, as a program that prepares once after loading its weights would (issue 33's first-cycle
target). (CUCACHE_LIB / CUCACHE_TORCH_HOOKS_LIB choose the libraries; docs/benchmarks.md quotes a
run.)
"""
import os, sys, time
PREPARE = "--prepare" in sys.argv[1:]
if any(a != "--prepare" for a in sys.argv[1:]):
    sys.exit(f"usage: {sys.argv[0]} [--prepare]")
sys.path.insert(0, os.path.join(os.getcwd(), "python"))
import cucache, cucache.torch
cucache.torch.install(hooks=True)
import torch
cucache.make_sleepable("w")
sizes = [3 << 30, 5 << 30, 700 << 20, 300 << 20] + [(1 << 20) * k for k in (1, 2, 3, 5, 8, 13)] + [4096 * k for k in range(1, 40)]
with cucache.tag("w"):
    ts = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
for t in ts[:4]:
    t.fill_(7)
torch.cuda.synchronize()
KEYS = ("vm_map_count", "vm_unmap_count", "vm_host_ns", "sync_host_ns", "vm_sync_count", "num_device_alloc", "num_device_free", "device_alloc_count", "device_free_count")
def snap():
    s = cucache.memory_stats()
    return {k: v for k, v in s.items() if isinstance(v, (int, float)) and any(x in k for x in ("vm_", "sync", "device_alloc", "device_free", "num_device"))}
def run(name, fn):
    a = snap(); t0 = time.perf_counter(); r = fn(); dt = time.perf_counter() - t0; b = snap()
    d = {k: b[k] - a.get(k, 0) for k in b if b[k] != a.get(k, 0)}
    ns = {k: round(v / 1e6, 1) for k, v in d.items() if k.endswith("_ns")}
    cnt = {k: v for k, v in d.items() if not k.endswith("_ns")}
    print(f"{name}: {dt*1e3:.1f} ms  ms={ns}  counts={cnt}", flush=True)
for cycle in range(3):
    run(f"c{cycle} sleep drop", lambda: cucache.sleep("w", keep_contents=False))
    run(f"c{cycle} wake", lambda: cucache.wake("w"))
for t in ts[:4]:
    t.fill_(7)
torch.cuda.synchronize()
if PREPARE:
    run("prepare_sleep", lambda: print("  pinned bytes:", cucache.prepare_sleep("w")))
for cycle in range(3):
    run(f"c{cycle} sleep keep", lambda: cucache.sleep("w", keep_contents=True))
    run(f"c{cycle} wake keep", lambda: cucache.wake("w"))
ok = all(bool((t[:1024] == 7).all()) for t in ts[:4])
print("contents kept after the keep cycles:", ok)
print(cucache.sleeping())
