"""Checks the cucache Python package's argument and error rules on the simulated device, without
torch (a fake torch module stands in for install()): devices as torch.cuda reads them (int,
'cuda', 'cuda:N', torch.device), values ctypes would truncate refused, devices that do not exist
refused, configuration errors as ValueError at install() and at the first use of CUCACHE_CONF,
a missing CUDA driver as RuntimeError naming it, a second install() with another conf refused,
NUL in tags refused, and text reads (snapshot_json, memory_summary) that hold while other threads
allocate. Each case runs in a process of its own (the configuration is read once per process).

    python3 tests/python/errors_check.py            (ctest python_errors; CI against the wheel)
    python3 tests/python/errors_check.py CASE       (one case, in this process)
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import types

from check_support import expect  # this folder is on the path

MIB = 1 << 20


class FakeDevice:  # torch.device's shape: .type and .index
    def __init__(self, type_: str, index):
        self.type, self.index = type_, index

    def __repr__(self) -> str:
        return f"device(type={self.type!r}, index={self.index})"


def install_fake_torch() -> types.SimpleNamespace:
    """A torch module with what cucache.torch.install() touches; records the allocator set."""
    torch = types.ModuleType("torch")
    state = types.SimpleNamespace(allocators=[])

    class CUDAPluggableAllocator:
        def __init__(self, path, alloc, free):
            self.path, self.alloc, self.free = path, alloc, free

    torch.cuda = types.SimpleNamespace(
        is_initialized=lambda: False,
        current_device=lambda: 0,
        memory=types.SimpleNamespace(
            CUDAPluggableAllocator=CUDAPluggableAllocator,
            change_current_allocator=state.allocators.append,
        ),
    )
    torch.device = FakeDevice
    sys.modules["torch"] = torch
    return state


# --- cases (each in its own process) --------------------------------------------------------------


def case_devices() -> None:
    import cucache

    s = cucache.memory_stats(0)
    for d in ("cuda:0", "cuda", " cuda:0 ", None, FakeDevice("cuda", 0), FakeDevice("cuda", None)):
        assert cucache.memory_stats(d) == s, d
        cucache.memory_summary(d)
        cucache.snapshot_json(d)
        cucache.reset_peak_memory_stats(d)
        cucache.tag_stats(d)
    p = cucache.alloc(MIB, "cuda:0")
    cucache.free(p, MIB, "cuda:0")
    p = cucache.alloc(MIB, FakeDevice("cuda", 0))
    cucache.free(p, MIB, FakeDevice("cuda", None))
    expect(ValueError, cucache.memory_stats, "cpu", match="not a CUDA device")
    expect(ValueError, cucache.memory_stats, "cuda:x", match="not a CUDA device")
    expect(ValueError, cucache.memory_stats, FakeDevice("cpu", None), match="not a CUDA device")
    expect(TypeError, cucache.memory_stats, 1.5, match="cannot read a device")
    expect(TypeError, cucache.memory_stats, True, match="bool")
    # Devices that do not exist (one simulated device): RuntimeError, as torch raises
    # (issue 32 item 8), -1 included (issue 30 item 10: reset_peak_memory_stats(-1) was taken).
    for fn in (cucache.memory_stats, cucache.memory_summary, cucache.snapshot_json,
               cucache.reset_peak_memory_stats, cucache.tag_stats, cucache.max_allocatable):
        expect(RuntimeError, fn, 7, match="device 7 does not exist")
        expect(RuntimeError, fn, "cuda:5", match="device 5 does not exist")
        expect(RuntimeError, fn, -1, match="device -1 does not exist")
    expect(RuntimeError, cucache.reset_peak_memory_stats, 99, match="device 99 does not exist: this process has 1 sim device")
    expect(RuntimeError, cucache.alloc, MIB, 1, match="device 1 does not exist")
    # Values ctypes would truncate.
    expect(ValueError, cucache.alloc, 2**64 + 512, 0, match="size 18446744073709552128 is out of range")
    expect(ValueError, cucache.alloc, -1, 0, match="out of range")
    expect(RuntimeError, cucache.alloc, MIB, 2**32, match="device 4294967296 does not exist")
    expect(RuntimeError, cucache.alloc, MIB, -1, match="device -1 does not exist")
    expect(ValueError, cucache.alloc, MIB, 0, 2**64, match="stream")
    expect(ValueError, cucache.reserve, 2**64, match="out of range")
    expect(TypeError, cucache.alloc, 1.0, 0, match="must be an int")
    assert cucache.memory_stats(0)["allocated_bytes.all.current"] == 0
    # Tags: NUL would cut the name short in C.
    expect(ValueError, cucache.push_tag, "a\0b", match="NUL")
    expect(TypeError, cucache.push_tag, b"ab", match="str")
    with cucache.tag("ab"):
        p = cucache.alloc(MIB, 0)
    assert "ab" in cucache.tag_stats(0), cucache.tag_stats(0)
    cucache.free(p, MIB, 0)


def case_bad_frees() -> None:
    # A free cucache refuses raises RuntimeError with its message, as torch's allocator does --
    # it returned None with a line on stderr (issue 32 item 5) -- changing nothing, and counts.
    import cucache

    p = cucache.alloc(MIB, 0)
    before = cucache.bad_free_count()
    cucache.free(p, MIB, 0)
    text = expect(RuntimeError, cucache.free, p, MIB, 0, match="it was already freed")
    assert text.startswith(f"cucache: free({p:#x}) on device 0: "), text
    assert text.count("cucache") == 1, f"the prefix is stacked: {text}"
    expect(RuntimeError, cucache.free, 0x1234, 16, 0, match="not allocated by cucache")
    q = cucache.alloc(4 * MIB, 0)
    expect(RuntimeError, cucache.free, q + 256, 16, 0, match="points 256 bytes into the live allocation")
    assert cucache.bad_free_count() == before + 3, cucache.bad_free_count()
    assert cucache.memory_stats(0)["allocation.all.current"] == 1
    cucache.free(q, 4 * MIB, 0)
    cucache.free(0, 0, 0)  # a no-op
    assert cucache.memory_stats(0)["allocated_bytes.all.current"] == 0
    # Errors of the C layers carry one "cucache" prefix, not one per layer.
    expect(RuntimeError, cucache.pop_tag, match="pop_tag")
    text = expect(RuntimeError, cucache.pop_tag)
    assert text.startswith("cucache: pop_tag: ") and text.count("cucache") == 1, text
    assert "failed" not in text and "cucache_torch" not in text, text


def case_text_growth() -> None:
    from cucache import _lib

    # A text that grows by 1 KiB at every call, as a snapshot does while other threads allocate:
    # read with the size the last call reported, it fits at the next call.
    calls = []

    def growing(_device, buf, n):
        text = b"x" * (10_000 + 1024 * len(calls))
        calls.append(n)
        if buf is not None and n > 0:
            k = min(len(text), n - 1)
            buf[:k] = text[:k]
            buf[k] = 0
        return len(text)

    out = _lib._text(growing, 0, "growing")
    assert len(out) >= 10_000 + 1024 and set(out) == {"x"}, len(out)
    assert len(calls) <= 3, calls

    # The real thing: snapshot_json while other threads allocate and free.
    import cucache

    stop = threading.Event()

    def churn(seed: int) -> None:
        live = []
        i = seed
        while not stop.is_set():
            i = (i * 1103515245 + 12345) % 2**31
            if len(live) < 64 and i % 3:
                live.append(cucache.alloc(512 + i % (4 * MIB), 0))
            elif live:
                cucache.free(live.pop(i % len(live)), 0, 0)
        for p in live:
            cucache.free(p, 0, 0)

    # One block first: until device 0 has allocated, memory_summary says so in one line instead of
    # the table, and the threads below may not have allocated by the first read.
    first = cucache.alloc(MIB, 0)
    workers = [threading.Thread(target=churn, args=(s,)) for s in (1, 2, 3)]
    for w in workers:
        w.start()
    try:
        for _ in range(300):
            assert cucache.snapshot_json(0).startswith("{")
            text = cucache.memory_summary(0)
            assert "Allocated memory" in text, text
    finally:
        stop.set()
        for w in workers:
            w.join()
        cucache.free(first, 0, 0)


def case_install_conf() -> None:
    fake = install_fake_torch()
    import cucache
    import cucache.torch as ct

    text = expect(ValueError, ct.install, conf="expandable_segment:True", hooks=False)
    assert "expandable_segment" in text, text
    assert "CUCACHE_CONF" not in os.environ or os.environ["CUCACHE_CONF"] != "expandable_segment:True"
    assert not ct.installed()["installed"]
    ct.install(conf="max_split_size_mb:64", hooks=False)
    assert len(fake.allocators) == 1 and fake.allocators[0].alloc == "cucache_torch_alloc"
    ct.install(conf="max_split_size_mb:64", hooks=False)  # the same: nothing to do
    ct.install(hooks=False)
    expect(RuntimeError, ct.install, conf="max_split_size_mb:128", hooks=False,
           match="cannot change in a running process")
    assert os.environ["CUCACHE_CONF"] == "max_split_size_mb:64"
    expect(ValueError, ct.install, conf="bogus:1", hooks=False, match="bogus")
    assert len(fake.allocators) == 1
    assert cucache.canonical_conf() == cucache.canonical_conf("max_split_size_mb:64")


def case_conf_after_use() -> None:
    install_fake_torch()
    import cucache
    import cucache.torch as ct

    cucache.memory_stats(0)  # reads CUCACHE_CONF (unset: the defaults)
    expect(RuntimeError, ct.install, conf="max_split_size_mb:64", hooks=False,
           match="cannot change in a running process")
    assert "CUCACHE_CONF" not in os.environ


def case_env_conf() -> None:
    # A bad CUCACHE_CONF in the environment: ValueError at the first use, every time, whatever
    # the call; never MemoryError.
    import cucache

    expect(ValueError, cucache.alloc, MIB, 0, match="bogus")
    expect(ValueError, cucache.memory_stats, match="bogus")
    expect(ValueError, cucache.reserve, MIB, match="configuration error")
    for fn in (cucache.empty_cache, cucache.snapshot, cucache.mark_step, cucache.leak_report):
        expect(ValueError, fn, match="bogus")
    expect(ValueError, cucache.push_tag, "t", match="bogus")
    install_fake_torch()
    import cucache.torch as ct

    expect(ValueError, ct.install, hooks=False, match="bogus")


def case_no_driver() -> None:
    import cucache

    if cucache.backend() == "cuda":
        try:
            cucache.max_allocatable(0)
        except RuntimeError:
            pass
        else:
            print("errors_check: SKIP no_driver: this machine has a usable CUDA driver")
            return
    expect(RuntimeError, cucache.alloc, MIB, 0, match="no usable CUDA driver")
    text = expect(RuntimeError, cucache.memory_stats, 0, match="no usable CUDA driver")
    assert "libcuda" in text and "CUCACHE_BACKEND=sim" in text, text


CASES = {
    "devices": {"CUCACHE_BACKEND": "sim"},
    "bad_frees": {"CUCACHE_BACKEND": "sim"},
    "text_growth": {"CUCACHE_BACKEND": "sim"},
    "install_conf": {"CUCACHE_BACKEND": "sim"},
    "conf_after_use": {"CUCACHE_BACKEND": "sim"},
    "env_conf": {"CUCACHE_BACKEND": "sim", "CUCACHE_CONF": "bogus:1"},
    "no_driver": {"CUCACHE_BACKEND": "cuda"},
}


def main() -> int:
    if len(sys.argv) > 1:
        globals()[f"case_{sys.argv[1]}"]()
        print(f"errors_check {sys.argv[1]}: ok")
        return 0
    failed = []
    for name, env in CASES.items():
        child = dict(os.environ)
        child.pop("CUCACHE_CONF", None)
        child.update(env)
        r = subprocess.run([sys.executable, __file__, name], env=child, capture_output=True, text=True)
        sys.stdout.write(r.stdout)
        if r.returncode != 0:
            sys.stdout.write(r.stderr)
            failed.append(name)
    if failed:
        print(f"errors_check: FAILED {failed}")
        return 1
    print("errors_check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
