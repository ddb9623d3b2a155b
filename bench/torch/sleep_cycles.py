"""A thousand sleep and wake cycles of two tags in one process (issue 33: no growth of host RSS or
pinned memory, no handle leaked, contents exact).

    CUCACHE_CONF=expandable_segments:True python bench/torch/sleep_cycles.py [--cycles N] [--mib M]

Tag "kept" (blocks of M/2, M/4, M/8 MiB and small ones, a pattern written once) sleeps keeping its
contents, after one prepare_sleep; tag "dropped" (the same shapes) sleeps dropping them and is
written again after each wake. Every cycle puts both to sleep and wakes both. Measured after the
first cycle and at the end: the process's resident host memory (VmRSS), the pinned bytes holding
"kept"'s contents (cucache.sleeping() while asleep), the live device handles and mappings
(memory_stats: num_device_alloc - num_device_free, vm_map_count - vm_unmap_count); "kept"'s
contents are compared with the pattern every 100 cycles and at the end. Prints one line per
measure, the median sleep and wake times per tag, and a verdict line: PASS when nothing grew
(RSS within 64 MiB: the allocator's and torch's own caches) and every comparison held.
(CUCACHE_LIB / CUCACHE_TORCH_HOOKS_LIB choose the libraries.)
"""
import argparse
import os
import statistics
import sys
import time

ap = argparse.ArgumentParser()
ap.add_argument("--cycles", type=int, default=1000)
ap.add_argument("--mib", type=int, default=1024, help="size of each tag's largest blocks, MiB")
args = ap.parse_args()
sys.path.insert(0, os.path.join(os.getcwd(), "python"))
import cucache, cucache.torch  # noqa: E402

cucache.torch.install(hooks=True)
import torch  # noqa: E402

MIB = 1 << 20
sizes = [args.mib * MIB // 2, args.mib * MIB // 4, args.mib * MIB // 8] + \
        [MIB * k for k in (1, 3, 5)] + [4096 * k for k in range(1, 20)]


def pattern(n, salt):
    return (torch.arange(n, dtype=torch.int64, device="cuda") * 7 + salt).remainder(251).to(torch.uint8)


def make(name):
    cucache.make_sleepable(name)
    with cucache.tag(name):
        return [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]


kept, dropped = make("kept"), make("dropped")
for i, t in enumerate(kept):
    t.copy_(pattern(t.numel(), i))
torch.cuda.synchronize()
cucache.prepare_sleep("kept")


def exact():
    return all(bool(torch.equal(t, pattern(t.numel(), i))) for i, t in enumerate(kept))


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def live():
    s = cucache.memory_stats()
    return (s["num_device_alloc"] - s["num_device_free"], s["vm_map_count"] - s["vm_unmap_count"])


times = {k: [] for k in ("kept sleep", "kept wake", "dropped sleep", "dropped wake")}
first = None
ok = True
t_start = time.perf_counter()
for c in range(args.cycles):
    for name, keep in (("kept", True), ("dropped", False)):
        t0 = time.perf_counter()
        cucache.sleep(name, keep_contents=keep)
        times[f"{name} sleep"].append(time.perf_counter() - t0)
    pinned = cucache.sleeping()["kept"]["host_bytes"]
    for name in ("kept", "dropped"):
        t0 = time.perf_counter()
        cucache.wake(name)
        times[f"{name} wake"].append(time.perf_counter() - t0)
    for t in dropped[:3]:
        t.fill_(c % 256)
    if c == 0:
        # The comparison's own temporaries (untagged) are cached from here on, as at the end.
        ok = exact() and ok
        torch.cuda.synchronize()
        first = {"rss": rss(), "pinned": pinned, "live": live()}
    if (c + 1) % 100 == 0 or c + 1 == args.cycles:
        if not exact():
            ok = False
            print(f"cycle {c + 1}: kept contents differ", flush=True)
torch.cuda.synchronize()
end = {"rss": rss(), "pinned": pinned, "live": live()}
wall = time.perf_counter() - t_start
print(f"cycles: {args.cycles} in {wall:.1f} s; tags of {sum(sizes) / MIB:.1f} MiB each")
print(f"host RSS: {first['rss'] / MIB:.1f} MiB after cycle 1, {end['rss'] / MIB:.1f} MiB at the end")
print(f"pinned bytes holding 'kept': {first['pinned']} after cycle 1, {end['pinned']} at the end")
print(f"live handles, mappings: {first['live']} after cycle 1, {end['live']} at the end")
for k, v in times.items():
    print(f"{k}: median {statistics.median(v) * 1e3:.2f} ms, max {max(v) * 1e3:.2f} ms")
grew = end["rss"] - first["rss"] > 64 * MIB or end["pinned"] != first["pinned"] or end["live"] != first["live"]
print("contents exact at every check:", ok)
print("VERDICT", "PASS" if ok and not grew else "FAIL")
