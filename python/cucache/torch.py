"""cucache as PyTorch's CUDA allocator (CUDAPluggableAllocator, or the hooks library where it was
built): no build step of its own, torch imported only by install().

    import cucache.torch
    cucache.torch.install(conf="expandable_segments:True")   # before any CUDA allocation
    ...
    print(cucache.torch.memory_summary())

PyTorch's own counters (torch.cuda.memory_stats, max_memory_reserved) cannot see a plug-in
allocator; read cucache's with memory_stats() here (the same as cucache.memory_stats). See
docs/torch.md.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any, Optional

from . import _lib
from ._lib import (
    _HOOKS_NAME,
    _check,
    bad_free_count,
    empty_cache,
    last_error,
    library,
    make_sleepable,
    memory_stats,
    memory_summary,
    reset_peak_memory_stats,
    sleep,
    sleeping,
    snapshot,
    snapshot_json,
    tag,
    tag_backward,
    wake,
)

__all__ = [
    "install",
    "installed",
    "library",
    "memory_stats",
    "memory_summary",
    "snapshot",
    "snapshot_json",
    "empty_cache",
    "record_stream",
    "reset_peak_memory_stats",
    "bad_free_count",
    "last_error",
    "make_sleepable",
    "sleep",
    "sleeping",
    "tag",
    "tag_backward",
    "wake",
]

_installed = False
_hooks = False


def _cuda_used(torch: Any) -> bool:
    # torch.cuda.is_initialized() is true once anything touched CUDA through torch; the native
    # allocator is then initialized and can no longer be swapped.
    return bool(torch.cuda.is_initialized())


def install(lib_path: Optional[str] = None, conf: Optional[str] = None, hooks: Optional[bool] = None) -> None:
    """Makes cucache PyTorch's CUDA allocator. Call before anything allocates CUDA memory.

    conf: a CUCACHE_CONF string (docs/config.md), checked here (ValueError naming the key when it
    is not valid) and set in the environment; without it, CUCACHE_CONF from the environment is
    checked the same way. The configuration is the process's from then on: a second install()
    with another conf raises RuntimeError, as does a conf that differs from the one an earlier
    cucache call already read. hooks: use libcucache_torch_hooks.so (record_stream, empty_cache,
    memory fraction, torch.cuda.memory_stats, OutOfMemoryError); None = when it is found beside
    the plug-in (or at $CUCACHE_TORCH_HOOKS_LIB).
    """
    global _installed, _hooks
    if _installed:
        _lib.configure(conf, "cucache.torch.install", lib_path)  # refuses another conf
        return
    import torch

    if _cuda_used(torch):
        raise RuntimeError(
            "cucache.torch.install() must run before CUDA is used: torch has initialized CUDA "
            "already, and with it its own allocator, which cannot be swapped any more. Call "
            "install() first thing, before any .cuda() / device='cuda' / torch.cuda call."
        )
    _lib.configure(conf, "cucache.torch.install", lib_path)
    lib_file = _lib.library_path()
    hooks_path = Path(os.environ.get("CUCACHE_TORCH_HOOKS_LIB") or Path(lib_file or "").with_name(_HOOKS_NAME))
    use_hooks = hooks_path.is_file() if hooks is None else hooks
    if use_hooks:
        if not hooks_path.is_file():
            raise FileNotFoundError(f"cucache: hooks requested but {hooks_path} is missing")
        hl = ctypes.CDLL(str(hooks_path))
        hl.cucache_torch_hooks_install.restype = ctypes.c_int
        _check(hl.cucache_torch_hooks_install(), "installing the hooks allocator")
        _hooks = True
    else:
        alloc = torch.cuda.memory.CUDAPluggableAllocator(lib_file, "cucache_torch_alloc", "cucache_torch_free")
        torch.cuda.memory.change_current_allocator(alloc)
    _lib.set_current_device_function(lambda: torch.cuda.current_device() if _cuda_used(torch) else 0)
    _installed = True


def installed() -> dict[str, Any]:
    """What install() did: whether it ran, the library, hooks or not, the backend."""
    # The backend only once installed: asking earlier would read CUCACHE_CONF before install().
    lib = library() if _installed else None
    return {
        "installed": _installed,
        "library": _lib.library_path(),
        "hooks": _hooks,
        "backend": lib.cucache_torch_backend_name().decode() if lib else None,
    }


def record_stream(tensor: Any, stream: Any) -> None:
    """tensor.record_stream(stream) for cucache: the plain plug-in cannot see torch's call, so a
    tensor used on a side stream must be recorded here too (docs/torch.md)."""
    if tensor.untyped_storage().nbytes() == 0:
        return
    ptr = tensor.untyped_storage().data_ptr()
    handle = getattr(stream, "cuda_stream", stream)
    _check(library().cucache_torch_record_stream(ctypes.c_void_p(ptr), ctypes.c_void_p(handle)), "record_stream")


