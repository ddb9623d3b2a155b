"""The plug-in library (libcucache_torch.so) through ctypes: one registry for every Python front
end (cucache.torch, cucache.cupy, cucache.numba), and the statistics API they share. No framework
is imported here."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path
from typing import Any, Optional

_LIB_NAME = "libcucache_torch.so"
_HOOKS_NAME = "libcucache_torch_hooks.so"
_POOLS = ("all", "small_pool", "large_pool")


class _Stat(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("current", "peak", "allocated", "freed")]


_STAT_ARRAYS = (
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "requested_bytes",
    "inactive_split_bytes",
    "allocation",
    "segment",
    "active",
    "inactive_split",
)
_COUNTERS = (
    "num_device_alloc",
    "num_device_free",
    "num_ooms",
    "num_alloc_retries",
    "oversize_allocations",
    "oversize_segments",
    "events_pending",
    "vm_create_count",
    "vm_release_count",
    "vm_map_count",
    "vm_unmap_count",
    "stitched_pages",
    "mapped_bytes",
    "unmapped_handle_bytes",
    "free_bytes",
    "free_block_count",
    "largest_free_block",
    "memory_limit",
    "device_total_bytes",
)


class _Stats(ctypes.Structure):
    # Mirrors cucache_torch_stats (src/integrations/torch/cucache_torch.h); the size is checked on load.
    _fields_ = (
        [(n, _Stat * 3) for n in _STAT_ARRAYS]
        + [(n, ctypes.c_uint64) for n in _COUNTERS]
        + [("fragmentation_external", ctypes.c_double), ("fragmentation_overhead", ctypes.c_double)]
    )


_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None
# How the front end in use names the current device (torch, CuPy, Numba); 0 until one is set.
_current_device: Any = None


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    env = os.environ.get("CUCACHE_LIB") or os.environ.get("CUCACHE_TORCH_LIB")
    paths = [Path(env)] if env else []
    # Installed: beside this file (pip install .). In the source tree: python/cucache/../../build/lib.
    paths += [here / _LIB_NAME, here.parent.parent / "build" / "lib" / _LIB_NAME]
    return paths


def _find_lib(lib_path: Optional[str]) -> Path:
    if lib_path:
        return Path(lib_path)
    for p in _candidates():
        if p.is_file():
            return p
    tried = ", ".join(str(p) for p in _candidates())
    raise FileNotFoundError(f"cucache: {_LIB_NAME} not found (tried {tried}); set CUCACHE_LIB")


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, sz, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int64, ctypes.c_uint64
    sigs = {
        "cucache_torch_alloc": (vp, [sz, i, vp]),
        "cucache_torch_free": (None, [vp, sz, i, vp]),
        "cucache_torch_record_stream": (i, [vp, vp]),
        "cucache_torch_empty_cache": (i, []),
        "cucache_torch_max_allocatable": (i, [i, ctypes.POINTER(sz)]),
        "cucache_torch_reserve": (i, [i, sz]),
        "cucache_torch_reset_peak_stats": (i, [i]),
        "cucache_torch_reset_accumulated_stats": (i, [i]),
        "cucache_torch_set_memory_fraction": (i, [i, ctypes.c_double]),
        "cucache_torch_get_stats": (i, [i, ctypes.POINTER(_Stats)]),
        "cucache_torch_stats_size": (sz, []),
        "cucache_torch_memory_summary": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_snapshot_json": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_last_error": (ctypes.c_char_p, []),
        "cucache_torch_bad_free_count": (u64, []),
        "cucache_torch_backend_name": (ctypes.c_char_p, []),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def library(lib_path: Optional[str] = None) -> ctypes.CDLL:
    """Loads the plug-in library once: lib_path, $CUCACHE_LIB (or $CUCACHE_TORCH_LIB), beside this
    package, or build/lib of the source tree."""
    global _lib, _lib_path
    if _lib is None:
        path = _find_lib(lib_path)
        # RTLD_GLOBAL: the hooks library resolves its cucache_torch_* calls against this copy.
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _declare(lib)
        if lib.cucache_torch_stats_size() != ctypes.sizeof(_Stats):
            raise RuntimeError(
                f"cucache: {path} has a stats struct of {lib.cucache_torch_stats_size()} bytes, "
                f"this module expects {ctypes.sizeof(_Stats)}: the module and library do not match"
            )
        _lib, _lib_path = lib, str(path)
    return _lib


def last_error() -> str:
    return (library().cucache_torch_last_error() or b"").decode(errors="replace")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"cucache: {what} failed: {last_error()}")


def library_path() -> Optional[str]:
    """The plug-in library loaded, or None before the first use."""
    return _lib_path


def set_current_device_function(fn: Any) -> None:
    """The front end's current device (a callable returning an int), for calls without device=."""
    global _current_device
    _current_device = fn


def _device(device: Any) -> int:
    if device is None:
        return int(_current_device()) if _current_device is not None else 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is None:
        index = getattr(device, "id", None)  # cupy.cuda.Device, numba's device
    if index is not None:
        return int(index)
    if isinstance(device, str) and ":" in device:
        return int(device.split(":", 1)[1])
    return 0


def backend() -> str:
    """"cuda", or "sim" on the simulated device (CUCACHE_BACKEND=sim)."""
    return (library().cucache_torch_backend_name() or b"").decode()


def alloc(size: int, device: int, stream: int = 0) -> int:
    """size bytes on device for use on stream (a cudaStream_t as an int); 0 for size 0. Raises
    MemoryError (with cucache's message) when cucache cannot allocate."""
    if size == 0:
        return 0
    p = library().cucache_torch_alloc(size, device, ctypes.c_void_p(stream or None))
    if not p:
        raise MemoryError(f"cucache: cannot allocate {size} bytes on device {device}: {last_error()}")
    return int(p)


def free(ptr: int, size: int, device: int, stream: int = 0) -> None:
    """Returns memory from alloc(). A stream other than the allocation's orders the free on it."""
    if ptr:
        library().cucache_torch_free(ctypes.c_void_p(ptr), size, device, ctypes.c_void_p(stream or None))


def snapshot(device: Any = None) -> dict[str, Any]:
    """Every segment and block of one device (snapshot_json(), parsed)."""
    return json.loads(snapshot_json(device))


def memory_stats(device: Any = None) -> dict[str, Any]:
    """cucache's statistics of one device, under torch.cuda.memory_stats()'s key names
    ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak", ...) plus cucache's own
    ("fragmentation.external", "fragmentation.overhead", "largest_free_block", ...)."""
    s = _Stats()
    _check(library().cucache_torch_get_stats(_device(device), ctypes.byref(s)), "get_stats")
    out: dict[str, Any] = {}
    for name in _STAT_ARRAYS:
        arr = getattr(s, name)
        for pool, st in zip(_POOLS, arr):
            for field in ("current", "peak", "allocated", "freed"):
                out[f"{name}.{pool}.{field}"] = int(getattr(st, field))
    for name in _COUNTERS:
        out[name] = int(getattr(s, name))
    out["fragmentation.external"] = float(s.fragmentation_external)
    out["fragmentation.overhead"] = float(s.fragmentation_overhead)
    return out


def _text(fn: Any, device: int, what: str) -> str:
    for _ in range(8):  # the text can grow between the two calls; retry until it fits
        n = fn(device, None, 0)
        if n < 0:
            _check(-1, what)
        buf = ctypes.create_string_buffer(int(n) + 1)
        m = fn(device, buf, len(buf))
        if m < 0:
            _check(-1, what)
        if m < len(buf):
            return buf.value.decode(errors="replace")
    raise RuntimeError(f"cucache: {what}: the text kept growing")


def memory_summary(device: Any = None) -> str:
    """PyTorch-style table of the statistics of one device."""
    return _text(library().cucache_torch_memory_summary, _device(device), "memory_summary")


def snapshot_json(device: Any = None) -> str:
    """Every segment and block of one device, as JSON."""
    return _text(library().cucache_torch_snapshot_json, _device(device), "snapshot_json")


def empty_cache() -> None:
    """Returns every wholly free cached segment of every device to the driver."""
    _check(library().cucache_torch_empty_cache(), "empty_cache")


def max_allocatable(device: Any = None) -> int:
    """The largest single allocation on one device that would succeed now, in bytes: a cached
    free block, or new memory once the out-of-memory path gave back what it may, under the
    device's free memory and the memory limit (exact on the simulated device)."""
    out = ctypes.c_size_t(0)
    _check(library().cucache_torch_max_allocatable(_device(device), ctypes.byref(out)), "max_allocatable")
    return int(out.value)


def reserve(nbytes: int, device: Any = None) -> None:
    """Caches nbytes of free memory on one device now, so that the first allocations make no
    device call (CUCACHE_CONF reserve_mb:N does it when the allocator is created)."""
    if nbytes < 0:
        raise ValueError(f"cucache.reserve: nbytes must be >= 0, not {nbytes}")
    _check(library().cucache_torch_reserve(_device(device), int(nbytes)), "reserve")


def reset_peak_memory_stats(device: Any = None) -> None:
    """Resets the peaks of one device (all devices with device=-1)."""
    d = -1 if device == -1 else _device(device)
    _check(library().cucache_torch_reset_peak_stats(d), "reset_peak_stats")


def bad_free_count() -> int:
    """Frees of pointers cucache did not own, or had freed already, seen so far."""
    return int(library().cucache_torch_bad_free_count())
