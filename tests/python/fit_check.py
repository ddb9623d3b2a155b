"""Checks cucache.fit (python/cucache/_fit.py) against cucache-replay ($CUCACHE_REPLAY) on the
synthetic PyTorch snapshots of tests/data/torch_snapshots: the answer is the tool's --fit answer,
exact on the simulated device (a multiple of 2 MiB that --capacity-gib passes, one step below
failing); capacity_gib adds fits; the note says what the reading did; refusals are ValueErrors
with the tool's message; a missing tool is a FileNotFoundError saying how to get one. The native
library is never loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "torch_snapshots"
REPLAY = os.environ["CUCACHE_REPLAY"]
MIB = 1 << 20
GIB = 1 << 30

import cucache  # noqa: E402  (PYTHONPATH=python)


def expect_raises(kind, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as e:
        assert text in str(e), f"{kind.__name__} without {text!r}: {e}"
        return
    raise AssertionError(f"no {kind.__name__} ({text!r})")


def replay_fits(path, capacity_bytes):
    out = subprocess.run([REPLAY, "--backend", "sim", "--json", "--capacity-gib",
                          repr(capacity_bytes / GIB), str(path)],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)["fits"]


def main():
    basic = DATA / "basic_p4.pickle"
    r = cucache.fit(basic)
    assert r["mode"] == "fit" and r["trace"] == "basic_p4", r
    assert r["peak_requested_bytes"] == 1000 + 3000 - 1000 + 500 + 4 * MIB, r
    assert r["allocations"] == 5 and r["events"] == 9, r
    m = r["min_capacity_bytes"]
    assert m % (2 * MIB) == 0 and r["peak_requested_bytes"] <= m <= r["unconstrained_peak_reserved_bytes"], r
    assert replay_fits(basic, m) is True
    assert replay_fits(basic, m - 2 * MIB) is False
    assert r["note"].startswith("PyTorch memory snapshot, device 0 (of 1 in device_traces): 15 entries"), r["note"]
    assert "capacity_bytes" not in r and "fits" not in r
    # Against a card.
    assert cucache.fit(basic, capacity_gib=m / GIB)["fits"] is True
    small = cucache.fit(basic, capacity_gib=(m - 2 * MIB) / GIB)
    assert small["fits"] is False and small["capacity_bytes"] == m - 2 * MIB, small
    # The same answer from the gzip'd file and from protocol 2; settings are passed on.
    assert cucache.fit(DATA / "basic_p4.pickle.gz")["min_capacity_bytes"] == m
    assert cucache.fit(str(DATA / "basic_p2.pickle"))["min_capacity_bytes"] == m
    exp = cucache.fit(basic, config="expandable_segments:True")
    assert exp["min_capacity_bytes"] <= m and exp["min_capacity_bytes"] % (2 * MIB) == 0, exp
    # A history without its start: the blocks before it are counted in.
    w = cucache.fit(DATA / "wrapped.pickle")
    assert w["peak_requested_bytes"] == 8192 + 4096 and "2 allocations made before the history" in w["note"], w
    # Devices.
    expect_raises(ValueError, "pick one (cucache-replay --device N, cucache.fit(path, device=N))",
                  cucache.fit, DATA / "two_devices.pickle")
    assert cucache.fit(DATA / "two_devices.pickle", device=1)["peak_requested_bytes"] == 12000
    # Refusals, with the tool's message.
    expect_raises(ValueError, "_record_memory_history(max_entries=100000)", cucache.fit,
                  DATA / "no_history.pickle")
    expect_raises(ValueError, "capacity_gib", cucache.fit, basic, capacity_gib=0)
    expect_raises(ValueError, "device", cucache.fit, basic, device=-1)
    expect_raises(ValueError, "backend", cucache.fit, basic, backend="tpu")
    expect_raises(FileNotFoundError, "no file", cucache.fit, DATA / "missing.pickle")
    expect_raises(FileNotFoundError, "is not an executable file", cucache.fit, basic,
                  replay=str(DATA / "missing-tool"))
    saved = os.environ.pop("CUCACHE_REPLAY")
    saved_path = os.environ.get("PATH", "")
    os.environ["PATH"] = str(DATA)  # no cucache-replay there
    try:
        expect_raises(FileNotFoundError, "cmake --build build --target cucache-replay", cucache.fit, basic)
    finally:
        os.environ["CUCACHE_REPLAY"] = saved
        os.environ["PATH"] = saved_path
    # cucache.fit loads nothing native.
    assert cucache.library_path() is None
    print("fit_check: all checks passed")


if __name__ == "__main__":
    main()
    sys.exit(0)
