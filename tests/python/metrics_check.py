"""Tag limits and metrics from Python (cucache.set_tag_limit / tag_limit / tag_stats,
cucache.metrics) through the plug-in library on the simulated device, without torch: a limit
refuses exactly past it with MemoryError naming the tag, its limit, its use and the request,
nothing else changing; the metrics text parsed by prometheus_client's own parser holds every
value memory_stats() and tag_stats() report; the collector serves them through a registry. The
prometheus_client part is skipped, with its reason, where prometheus_client is not installed
(tools/install_deps.sh --tests installs it).

    CUCACHE_BACKEND=sim CUCACHE_LIB=build/lib/libcucache_torch.so PYTHONPATH=python \\
        python3 tests/python/metrics_check.py        (ctest python_metrics)
"""

from __future__ import annotations

import os
import sys

from check_support import expect  # this folder is on the path

MIB = 1 << 20


def check_tag_limits(cucache) -> None:
    assert cucache.tag_limit("kv") is None
    cucache.set_tag_limit("kv", 10 * MIB)
    assert cucache.tag_limit("kv") == 10 * MIB
    with cucache.tag("kv"):
        a = cucache.alloc(4 * MIB)
        b = cucache.alloc(6 * MIB)  # exactly at the limit
        before = cucache.memory_stats()
        text = expect(MemoryError, cucache.alloc, 1, match="out of memory under tag 'kv' on device 0")
        for part in ("allocating 1 B (1 bytes)", "limit of 10.00 MiB (10485760 bytes)",
                     "it uses 10.00 MiB (10485760 bytes)"):
            assert part in text, text
        assert cucache.memory_stats() == before  # nothing else changed
    other = cucache.alloc(32 * MIB)  # untagged: free to allocate
    t = cucache.tag_stats()["kv"]
    assert t == {"current_bytes": 10 * MIB, "peak_bytes": 10 * MIB, "allocations": 2,
                 "total_allocations": 2, "limit_bytes": 10 * MIB, "limit_refusals": 1}, t
    cucache.set_tag_limit("kv", None)
    assert cucache.tag_limit("kv") is None
    assert cucache.tag_stats()["kv"]["limit_bytes"] is None
    expect(ValueError, cucache.set_tag_limit, "", 1, match="the tag is empty")
    expect(ValueError, cucache.set_tag_limit, "kv", -1, match="out of range")
    expect(TypeError, cucache.set_tag_limit, 3, 1, match="a tag is a str")
    for p in (a, b, other):
        cucache.free(p, 0)
    cucache.set_tag_limit("kv", 64 * MIB)


def check_metrics(cucache) -> None:
    import cucache.metrics

    with cucache.tag('odd "tag"\\'):
        held = cucache.alloc(3 * MIB)
    text = cucache.metrics.text()
    assert text.endswith("\n") and "# TYPE cucache_allocated_bytes gauge" in text, text[:400]
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError:
        print("metrics_check: SKIPPED the prometheus_client checks: prometheus_client is not "
              "installed for " + sys.executable + " (tools/install_deps.sh --tests installs it)")
        cucache.free(held, 0)
        sys.exit(77)  # ctest: skipped (the tag limit checks above have run)
    samples = {}
    types = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            types[s.name] = fam.type
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in samples, key
            samples[key] = s.value
    stats = cucache.memory_stats()
    pools = {"all": "all", "small_pool": "small_pool", "large_pool": "large_pool"}
    # Per-pool fields: memory_stats' "<torch name>.<pool>.<part>" is the metric's sample.
    per_pool = {"allocated_bytes": "allocated_bytes", "reserved_bytes": "reserved_bytes",
                "active_bytes": "active_bytes", "requested_bytes": "requested_bytes",
                "inactive_split_bytes": "inactive_split_bytes", "allocation": "allocation_count",
                "segment": "segment_count", "active": "active_count",
                "inactive_split": "inactive_split_count"}
    checked = 0
    for torch_name, member in per_pool.items():
        for pool in pools:
            for part, suffix in (("current", ""), ("peak", "_peak"), ("allocated", "_allocated_total"),
                                 ("freed", "_freed_total")):
                key = (f"cucache_{member}{suffix}", (("device", "0"), ("pool", pool)))
                assert samples[key] == stats[f"{torch_name}.{pool}.{part}"], (key, samples[key])
                checked += 1
    scalars = {"num_device_alloc": "cucache_device_alloc_count_total",
               "num_ooms": "cucache_oom_count_total", "free_bytes": "cucache_free_bytes",
               "largest_free_block": "cucache_largest_free_block_bytes",
               "device_total_bytes": "cucache_device_total_bytes",
               "fragmentation.external": "cucache_external_fragmentation_ratio",
               "fragmentation.overhead": "cucache_overhead_fragmentation_ratio"}
    for key_name, metric in scalars.items():
        assert samples[(metric, (("device", "0"),))] == stats[key_name], metric
        checked += 1
    assert samples[("cucache_vm_host_seconds_total", (("device", "0"),))] == stats["vm_host_ns"] / 1e9
    assert types["cucache_device_alloc_count_total"] == "counter"
    assert types["cucache_allocated_bytes"] == "gauge"
    for name, t in cucache.tag_stats().items():
        labels = (("device", "0"), ("tag", name))
        assert samples[("cucache_tag_bytes", labels)] == t["current_bytes"]
        assert samples[("cucache_tag_peak_bytes", labels)] == t["peak_bytes"]
        assert samples[("cucache_tag_live_allocations", labels)] == t["allocations"]
        assert samples[("cucache_tag_allocations_total", labels)] == t["total_allocations"]
        assert samples[("cucache_tag_limit_refusals_total", labels)] == t["limit_refusals"]
        if t["limit_bytes"] is None:
            assert ("cucache_tag_limit_bytes", labels) not in samples
        else:
            assert samples[("cucache_tag_limit_bytes", labels)] == t["limit_bytes"]
        checked += 1
    assert samples[("cucache_tag_bytes", (("device", "0"), ("tag", 'odd "tag"\\')))] == 3 * MIB
    assert samples[("cucache_tag_limit_bytes", (("device", "0"), ("tag", "kv")))] == 64 * MIB

    # The collector, through a registry of its own: what prometheus_client serves parses again.
    import prometheus_client

    registry = prometheus_client.CollectorRegistry()
    cucache.metrics.register(registry)
    served = prometheus_client.generate_latest(registry).decode()
    again = {}
    for fam in text_string_to_metric_families(served):
        for s in fam.samples:
            again[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert again == samples, set(again.items()) ^ set(samples.items())
    assert registry.get_sample_value("cucache_tag_bytes", {"device": "0", "tag": "kv"}) == 0
    cucache.free(held, 0)
    print(f"metrics_check: {len(samples)} samples parsed by prometheus_client, {checked} compared")


def main() -> None:
    os.environ.setdefault("CUCACHE_BACKEND", "sim")
    os.environ.setdefault("CUCACHE_CONF", "")
    import cucache

    check_tag_limits(cucache)
    check_metrics(cucache)
    print("metrics_check: ok")


if __name__ == "__main__":
    main()
