"""Sleep and wake from Python (cucache.make_sleepable / tag(sleepable=True) / sleep / wake /
sleeping) through the plug-in library on the simulated device, without torch: pointers stay, the
reserved bytes fall and come back, memory_stats and memory_summary show the sleeping bytes, and
every misuse raises with cucache's message and changes nothing. The torch loop of the same API
on an H200 is bench/torch/sleep_wake.py (tools/gpu_sleep.sh).

    CUCACHE_BACKEND=sim CUCACHE_CONF=expandable_segments:True CUCACHE_LIB=build/lib/libcucache_torch.so \\
        PYTHONPATH=python python3 tests/python/sleep_check.py        (ctest python_sleep)
"""

from __future__ import annotations

import os
import threading

from check_support import expect  # this folder is on the path

MIB = 1 << 20


def main() -> None:
    os.environ.setdefault("CUCACHE_BACKEND", "sim")
    os.environ["CUCACHE_CONF"] = "expandable_segments:True"
    import cucache

    untagged = cucache.alloc(3 * MIB)
    with cucache.tag("train", sleepable=True):
        weights = cucache.alloc(40 * MIB)
        small = cucache.alloc(4096)
    with cucache.tag("infer", sleepable=True):
        kv = cucache.alloc(10 * MIB)
    before = cucache.memory_stats()
    assert before["reserved_bytes.all.current"] == (4 + 40 + 2 + 10) * MIB, before
    # The kept sleep's host buffer pinned ahead, on another thread (the call releases the GIL and
    # no allocator lock is held while pinning): the tag's allocated bytes now.
    got: list[int] = []
    t = threading.Thread(target=lambda: got.append(cucache.prepare_sleep("train")))
    t.start()
    t.join()
    assert got == [40 * MIB + 4096], got
    assert cucache.prepare_sleep("train", 64 * MIB) == 64 * MIB  # room to grow
    assert cucache.prepare_sleep("train") == 64 * MIB  # large enough already
    expect(RuntimeError, cucache.prepare_sleep, "nobody", match="prepare_sleep: unknown tag 'nobody'")
    expect(ValueError, cucache.prepare_sleep, "train", -1)
    expect(TypeError, cucache.prepare_sleep, "train", "big")

    cucache.sleep("train")  # keep_contents=True
    s = cucache.memory_stats()
    assert s["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] - 42 * MIB, s
    assert s["sleeping_bytes"] == 42 * MIB, s
    assert s["sleeping_host_bytes"] == 40 * MIB + 4096, s
    sl = cucache.sleeping()
    assert set(sl) == {"train"} and sl["train"]["bytes"] == 42 * MIB, sl
    assert sl["train"]["host_bytes"] == 40 * MIB + 4096 and sl["train"]["copy_seconds"] >= 0, sl
    assert "Sleeping tags" in cucache.memory_summary()
    # Misuses: each a RuntimeError (ValueError for an allocation under a sleeping tag, as the C
    # API's cudaErrorInvalidValue) naming the problem.
    expect(RuntimeError, cucache.sleep, "train", match="asleep already")
    expect(RuntimeError, cucache.prepare_sleep, "train", match="tag 'train' on device 0 is asleep")
    expect(RuntimeError, cucache.wake, "infer", match="is not asleep")
    expect(RuntimeError, cucache.sleep, "nobody", match="unknown tag 'nobody'")
    with cucache.tag("plain"):
        plain = cucache.alloc(MIB)
    expect(RuntimeError, cucache.sleep, "plain", match="is not sleepable")
    with cucache.tag("train"):
        expect(ValueError, cucache.alloc, MIB, match="tag 'train' is asleep")
    bad_before = cucache.bad_free_count()
    # Refused, raising as torch's allocator does: the block stays allocated.
    text = expect(RuntimeError, cucache.free, weights, 40 * MIB, match="which is asleep")
    assert text.startswith("cucache: free(") and text.count("cucache") == 1, text
    assert cucache.bad_free_count() == bad_before + 1
    assert "which is asleep" in cucache.last_error(), cucache.last_error()
    assert cucache.memory_stats()["sleeping_bytes"] == 42 * MIB
    expect(TypeError, cucache.sleep, 3)
    # keep_contents is a bool: a string (even 'no') is refused, not taken as True; nothing sleeps.
    for bad in ("no", "False", None, 0.0, 2):
        expect(TypeError, cucache.sleep, "infer", keep_contents=bad, match="keep_contents")
    assert set(cucache.sleeping()) == {"train"}, cucache.sleeping()
    expect(ValueError, cucache.sleep, "a\0b")

    # Both asleep: the device holds only the untagged and the plain blocks.
    cucache.sleep("infer", keep_contents=False)
    assert cucache.memory_stats()["reserved_bytes.all.current"] == (4 + 2) * MIB
    assert set(cucache.sleeping()) == {"train", "infer"}
    assert cucache.wake("train") >= 0.0
    assert cucache.wake("infer") == 0.0  # nothing kept
    after = cucache.memory_stats()
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] + 2 * MIB
    assert after["sleeping_bytes"] == 0 and cucache.sleeping() == {}
    for p, n in ((weights, 40 * MIB), (small, 4096), (kv, 10 * MIB), (untagged, 3 * MIB), (plain, MIB)):
        cucache.free(p, n)
    assert cucache.bad_free_count() == bad_before + 1
    assert cucache.memory_stats()["allocated_bytes.all.current"] == 0
    check_several_tags(cucache)
    check_tag_backward(cucache)
    print("sleep_check: ok")


def check_several_tags(cucache: object) -> None:
    """sleep / wake of a list of tags in one call (vLLM's sleep: weights kept, KV cache dropped):
    refusals change nothing for any tag; the one-tag form stays as it was."""
    with cucache.tag("weights2", sleepable=True):
        w = cucache.alloc(8 * MIB)
    with cucache.tag("kv2", sleepable=True):
        kv = cucache.alloc(4 * MIB)
    reserved = cucache.memory_stats()["reserved_bytes.all.current"]
    expect(RuntimeError, cucache.sleep, ["weights2", "weights2"], match="named twice")
    expect(RuntimeError, cucache.sleep, ["weights2", "nobody"], match="unknown tag 'nobody'")
    expect(ValueError, cucache.sleep, ["weights2", "kv2"], [True], match="2 tags but 1")
    expect(TypeError, cucache.sleep, ["weights2", "kv2"], [True, "no"], match="keep_contents")
    expect(TypeError, cucache.sleep, ["weights2", "kv2"], "yes", match="keep_contents")
    expect(RuntimeError, cucache.sleep, [], match="empty")
    assert cucache.sleeping() == {}, cucache.sleeping()
    assert cucache.memory_stats()["reserved_bytes.all.current"] == reserved
    cucache.sleep(["weights2", "kv2"], [True, False])
    sl = cucache.sleeping()
    assert set(sl) == {"weights2", "kv2"}, sl
    assert sl["weights2"]["host_bytes"] == 8 * MIB and sl["kv2"]["host_bytes"] == 0, sl
    s = cucache.memory_stats()
    assert s["reserved_bytes.all.current"] == reserved - 12 * MIB, s
    expect(RuntimeError, cucache.wake, ["weights2", "train"], match="tag 'train' on device 0 is not asleep")
    assert set(cucache.sleeping()) == {"weights2", "kv2"}
    assert cucache.wake(("kv2", "weights2")) >= 0.0
    assert cucache.sleeping() == {}
    assert cucache.memory_stats()["reserved_bytes.all.current"] == reserved
    cucache.sleep(["weights2", "kv2"], keep_contents=False)  # one bool for all
    assert cucache.sleeping()["weights2"]["host_bytes"] == 0
    cucache.wake(["weights2", "kv2"])
    cucache.free(w, 8 * MIB)
    cucache.free(kv, 4 * MIB)


class FakeLoss:
    """What tag_backward needs of a torch tensor: register_hook; backward() runs the hooks on a
    worker thread, as torch's engine does for CUDA tensors, then allocates there (a gradient)."""

    def __init__(self, cucache: object, grad_bytes: int) -> None:
        self.cucache, self.grad_bytes, self.hooks = cucache, grad_bytes, []

    def register_hook(self, fn: object) -> None:
        self.hooks.append(fn)

    def run_hooks_and_allocate(self) -> int:
        for h in self.hooks:
            assert h("grad") == "grad"
        return self.cucache.alloc(self.grad_bytes)

    def backward(self) -> int:
        out: list[int] = []
        t = threading.Thread(target=lambda: out.append(self.run_hooks_and_allocate()))
        t.start()
        t.join()
        return out[0]


def check_tag_backward(cucache: object) -> None:
    """tag_backward: the worker thread's gradient counts for the tag and sleeps with it; on the
    caller's own thread the hook changes nothing; bad arguments raise."""
    before = cucache.tag_stats().get("actor", {}).get("current_bytes", 0)
    loss = FakeLoss(cucache, 6 * MIB)
    cucache.tag_backward(loss, "actor", sleepable=True)
    grad = loss.backward()
    stats = cucache.tag_stats()
    assert stats["actor"]["current_bytes"] == before + 6 * MIB, stats
    cucache.sleep("actor", keep_contents=False)
    assert cucache.sleeping()["actor"]["bytes"] == 6 * MIB, cucache.sleeping()
    cucache.wake("actor")
    # A CPU backward runs the hook on the caller's thread: the caller's tags stay as they were.
    cpu_loss = FakeLoss(cucache, MIB)
    cucache.tag_backward(cpu_loss, "actor")
    untagged = cpu_loss.run_hooks_and_allocate()
    assert cucache.tag_stats()["actor"]["current_bytes"] == before + 6 * MIB
    expect(TypeError, cucache.tag_backward, object(), "actor", match="register_hook")
    expect(ValueError, cucache.tag_backward, loss, "a\0b")
    expect(TypeError, cucache.tag_backward, loss, 7)
    cucache.free(grad, 6 * MIB)
    cucache.free(untagged, MIB)


if __name__ == "__main__":
    main()
