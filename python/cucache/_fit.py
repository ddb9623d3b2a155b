"""cucache.fit: "does this job fit on a card of N GiB" from a PyTorch memory snapshot (or a
cucache / RMM CSV trace), answered by replaying it through cucache-replay --fit. Nothing is
allocated here and the native library is not loaded: the tool replays on the simulated device
unless backend="cuda" is asked for. See docs/python.md ("Will it fit") and docs/replay.md."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from typing import Any, Dict, Optional, Sequence

_GIB = 1 << 30


def _replay_tool(replay: Optional[str]) -> str:
    """The cucache-replay to run: `replay`, else $CUCACHE_REPLAY, else the one on PATH."""
    for source, path in (("replay=", replay), ("CUCACHE_REPLAY", os.environ.get("CUCACHE_REPLAY"))):
        if path:
            if not (os.path.isfile(path) and os.access(path, os.X_OK)):
                raise FileNotFoundError(f"cucache.fit: {source} {path!r} is not an executable file")
            return path
    found = shutil.which("cucache-replay")
    if found is None:
        raise FileNotFoundError(
            "cucache.fit needs the cucache-replay tool, which the Python package does not ship: "
            "build it (cmake --build build --target cucache-replay) and put it on PATH, set "
            "CUCACHE_REPLAY=/path/to/cucache-replay, or pass replay=")
    return found


def fit(
    path: "os.PathLike[str] | str",
    capacity_gib: Optional[float] = None,
    *,
    device: Optional[int] = None,
    config: Optional[str] = None,
    resolution_mib: Optional[float] = None,
    backend: str = "sim",
    peers: Optional[Sequence[str]] = None,
    replay: Optional[str] = None,
) -> Dict[str, Any]:
    """The minimum capacity of the job `path` recorded: the smallest memory limit under which
    its allocations replay through cucache with no out-of-memory (cucache-replay --fit).

    path: a snapshot written by torch.cuda.memory._dump_snapshot (after
    torch.cuda.memory._record_memory_history(max_entries=...)), plain or gzip, or a CSV trace.
    capacity_gib: a card's memory; adds "capacity_bytes" and "fits" (min capacity <= it).
    device: the snapshot device whose history is replayed (needed when several have one).
    config: cucache settings in CUCACHE_CONF syntax (e.g. "expandable_segments:True"); None: the
    defaults (CUCACHE_CONF in the environment is not passed on).
    resolution_mib: the bisection's step (default 2 MiB, exact on the simulated device).
    backend: "sim" (default; no GPU needed, deterministic) or "cuda"; peers (cuda only, e.g.
    ["c10"]): PyTorch's allocator and cudaMallocAsync fitted in the same run.
    replay: the cucache-replay binary (default $CUCACHE_REPLAY, else PATH).

    Returns the dict of cucache-replay --fit --json (docs/replay.md, "Minimum capacity"):
    "min_capacity_bytes", "peak_requested_bytes", "min_capacity_over_requested",
    "fails_at_bytes", "unconstrained_peak_reserved_bytes", "peers", ... plus "note", what the
    reading of a snapshot did (allocations before its history, free_completed not replayed), and
    with capacity_gib "capacity_bytes" and "fits". Raises ValueError with the tool's message for a
    file it refuses (no history recorded, several devices without device=, a corrupt pickle),
    FileNotFoundError when the file or the tool is missing."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"cucache.fit: no file {path!r}")
    if backend not in ("sim", "cuda"):
        raise ValueError(f"cucache.fit: backend {backend!r} (expected 'sim' or 'cuda')")
    if capacity_gib is not None and (isinstance(capacity_gib, bool) or not isinstance(capacity_gib, (int, float)) or not capacity_gib > 0):
        raise ValueError(f"cucache.fit: capacity_gib {capacity_gib!r} must be a positive number of GiB")
    if device is not None and (isinstance(device, bool) or not isinstance(device, int) or device < 0):
        raise ValueError(f"cucache.fit: device {device!r} must be an int >= 0")
    args = [_replay_tool(replay), "--fit", "--json", "--backend", backend]
    if device is not None:
        args += ["--device", str(device)]
    if config is not None:
        args += ["--config", config]
    if resolution_mib is not None:
        args += ["--fit-resolution-mib", repr(float(resolution_mib))]
    if peers is not None:
        args += ["--peers", ",".join(peers) if peers else "none"]
    args.append(path)
    env = dict(os.environ)
    env.pop("CUCACHE_CONF", None)  # config= says the settings; the caller's variable does not leak in
    env["CUCACHE_NO_PROGRESS"] = "1"
    done = subprocess.run(args, capture_output=True, text=True, env=env, check=False)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    if done.returncode != 0:
        errors = [line for line in lines if line.startswith("cucache-replay: error: ")]
        message = errors[-1][len("cucache-replay: error: "):] if errors else "\n".join(lines)
        raise ValueError(f"cucache.fit: {message or f'cucache-replay exited with {done.returncode}'}")
    out = [line for line in done.stdout.splitlines() if line.strip()]
    if len(out) != 1:
        raise RuntimeError(f"cucache.fit: expected one JSON line from cucache-replay, got {len(out)}")
    result: Dict[str, Any] = json.loads(out[0])
    name = result.get("trace", "")
    prefix = f"cucache-replay: {name}: "
    notes = [line[len(prefix):] for line in lines if line.startswith(prefix)]
    result["note"] = notes[0] if notes else ""
    if capacity_gib is not None:
        capacity = int(round(capacity_gib * _GIB))
        result["capacity_bytes"] = capacity
        result["fits"] = result["min_capacity_bytes"] <= capacity
    return result
