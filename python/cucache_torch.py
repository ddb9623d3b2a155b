"""cucache as PyTorch's CUDA allocator, through ctypes: no build step, torch imported only on use.

    import cucache_torch
    cucache_torch.install(conf="expandable_segments:True")   # before any CUDA allocation
    ...
    print(cucache_torch.memory_summary())

PyTorch's own counters (torch.cuda.memory_stats, max_memory_reserved) cannot see a plug-in
allocator; read cucache's with memory_stats() here. See docs/torch.md.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Optional

__all__ = [
    "install",
    "installed",
    "library",
    "memory_stats",
    "memory_summary",
    "snapshot_json",
    "empty_cache",
    "record_stream",
    "reset_peak_memory_stats",
    "bad_free_count",
    "last_error",
]

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
_installed = False
_hooks = False


def _candidates() -> list[Path]:
    here = Path(__file__).resolve().parent
    env = os.environ.get("CUCACHE_TORCH_LIB")
    paths = [Path(env)] if env else []
    paths += [here / _LIB_NAME, here.parent / "build" / "lib" / _LIB_NAME]
    return paths


def _find_lib(lib_path: Optional[str]) -> Path:
    if lib_path:
        return Path(lib_path)
    for p in _candidates():
        if p.is_file():
            return p
    tried = ", ".join(str(p) for p in _candidates())
    raise FileNotFoundError(f"cucache_torch: {_LIB_NAME} not found (tried {tried}); set CUCACHE_TORCH_LIB")


def _declare(lib: ctypes.CDLL) -> None:
    vp, i, sz, i64, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int64, ctypes.c_uint64
    sigs = {
        "cucache_torch_alloc": (vp, [sz, i, vp]),
        "cucache_torch_free": (None, [vp, sz, i, vp]),
        "cucache_torch_record_stream": (i, [vp, vp]),
        "cucache_torch_empty_cache": (i, []),
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
    """Loads libcucache_torch.so once (lib_path, $CUCACHE_TORCH_LIB, beside this file, build/lib)."""
    global _lib, _lib_path
    if _lib is None:
        path = _find_lib(lib_path)
        # RTLD_GLOBAL: the hooks library resolves its cucache_torch_* calls against this copy.
        lib = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        _declare(lib)
        if lib.cucache_torch_stats_size() != ctypes.sizeof(_Stats):
            raise RuntimeError(
                f"cucache_torch: {path} has a stats struct of {lib.cucache_torch_stats_size()} bytes, "
                f"this module expects {ctypes.sizeof(_Stats)}: the module and library do not match"
            )
        _lib, _lib_path = lib, str(path)
    return _lib


def last_error() -> str:
    return (library().cucache_torch_last_error() or b"").decode(errors="replace")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"cucache_torch: {what} failed: {last_error()}")


def _cuda_used(torch: Any) -> bool:
    # torch.cuda.is_initialized() is true once anything touched CUDA through torch; the native
    # allocator is then initialized and can no longer be swapped.
    return bool(torch.cuda.is_initialized())


def install(lib_path: Optional[str] = None, conf: Optional[str] = None, hooks: Optional[bool] = None) -> None:
    """Makes cucache PyTorch's CUDA allocator. Call before anything allocates CUDA memory.

    conf: a CUCACHE_CONF string (docs/config.md), set in the environment before the first
    allocation reads it. hooks: use libcucache_torch_hooks.so (record_stream, empty_cache,
    memory fraction, torch.cuda.memory_stats, OutOfMemoryError); None = when it is found beside
    the plug-in (or at $CUCACHE_TORCH_HOOKS_LIB).
    """
    global _installed, _hooks
    if _installed:
        return
    import torch

    if _cuda_used(torch):
        raise RuntimeError(
            "cucache_torch.install() must run before CUDA is used: torch has initialized CUDA "
            "already, and with it its own allocator, which cannot be swapped any more. Call "
            "install() first thing, before any .cuda() / device='cuda' / torch.cuda call."
        )
    if conf is not None:
        os.environ["CUCACHE_CONF"] = conf
    lib = library(lib_path)
    hooks_path = Path(os.environ.get("CUCACHE_TORCH_HOOKS_LIB") or Path(_lib_path or "").with_name(_HOOKS_NAME))
    use_hooks = hooks_path.is_file() if hooks is None else hooks
    if use_hooks:
        if not hooks_path.is_file():
            raise FileNotFoundError(f"cucache_torch: hooks requested but {hooks_path} is missing")
        hl = ctypes.CDLL(str(hooks_path))
        hl.cucache_torch_hooks_install.restype = ctypes.c_int
        _check(hl.cucache_torch_hooks_install(), "installing the hooks allocator")
        _hooks = True
    else:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "cucache_torch_alloc", "cucache_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    _installed = True


def installed() -> dict[str, Any]:
    """What install() did: whether it ran, the library, hooks or not, the backend."""
    lib = library() if _lib is not None or _installed else None
    return {
        "installed": _installed,
        "library": _lib_path,
        "hooks": _hooks,
        "backend": lib.cucache_torch_backend_name().decode() if lib else None,
    }


def _device(device: Any) -> int:
    if device is None:
        import torch

        return torch.cuda.current_device() if _cuda_used(torch) else 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)
    if index is not None:
        return int(index)
    if isinstance(device, str) and ":" in device:
        return int(device.split(":", 1)[1])
    return 0


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
    raise RuntimeError(f"cucache_torch: {what}: the text kept growing")


def memory_summary(device: Any = None) -> str:
    """PyTorch-style table of the statistics of one device."""
    return _text(library().cucache_torch_memory_summary, _device(device), "memory_summary")


def snapshot_json(device: Any = None) -> str:
    """Every segment and block of one device, as JSON."""
    return _text(library().cucache_torch_snapshot_json, _device(device), "snapshot_json")


def empty_cache() -> None:
    """Returns every wholly free cached segment to the device (torch.cuda.empty_cache() does this
    only with the hooks library)."""
    _check(library().cucache_torch_empty_cache(), "empty_cache")


def record_stream(tensor: Any, stream: Any) -> None:
    """tensor.record_stream(stream) for cucache: the plain plug-in cannot see torch's call, so a
    tensor used on a side stream must be recorded here too (docs/torch.md)."""
    if tensor.untyped_storage().nbytes() == 0:
        return
    ptr = tensor.untyped_storage().data_ptr()
    handle = getattr(stream, "cuda_stream", stream)
    _check(library().cucache_torch_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(handle)), "record_stream")


def reset_peak_memory_stats(device: Any = None) -> None:
    """Resets the peaks of one device (all devices with device=-1)."""
    d = -1 if device == -1 else _device(device)
    _check(library().cucache_torch_reset_peak_stats(d), "reset_peak_stats")


def bad_free_count() -> int:
    """Frees of pointers cucache did not own, or had freed already, seen so far."""
    return int(library().cucache_torch_bad_free_count())
