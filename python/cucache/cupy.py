"""cucache as CuPy's device memory allocator (cupy.cuda.set_allocator).

    import cucache.cupy
    cucache.cupy.install()          # every later CuPy allocation is cucache's
    ...
    print(cucache.memory_summary())

Each allocation is cucache memory on the current device for use on CuPy's current stream, handed to
CuPy as a MemoryPointer over cupy.cuda.UnownedMemory whose owner returns it to cucache when CuPy
drops the last reference. CuPy's own pool is bypassed (cucache caches). cupy is imported only by
install(). See docs/python.md.
"""

from __future__ import annotations

from typing import Any, Optional

from . import _lib
from ._lib import memory_stats, memory_summary, snapshot  # noqa: F401  (the shared API)

__all__ = ["install", "uninstall", "installed", "allocator", "memory_stats", "memory_summary", "snapshot"]

_installed = False
_previous: Any = None


class _Allocation:
    """Owner of one cucache allocation: frees it when CuPy drops the memory."""

    __slots__ = ("ptr", "size", "device", "stream", "__weakref__")

    def __init__(self, ptr: int, size: int, device: int, stream: int) -> None:
        self.ptr, self.size, self.device, self.stream = ptr, size, device, stream

    def __del__(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            # The allocation's stream: reusable on it at once, as CuPy's pool reuses per stream.
            _lib._release(ptr, self.size, self.device, self.stream)


def allocator(size: int) -> Any:
    """The function install() gives cupy.cuda.set_allocator: size -> cupy.cuda.MemoryPointer."""
    import cupy

    device = int(cupy.cuda.runtime.getDevice())
    stream = int(cupy.cuda.get_current_stream().ptr)
    if size == 0:
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(0, 0, None, device), 0)
    try:
        ptr = _lib.alloc(size, device, stream)
    except MemoryError as e:
        oom = getattr(getattr(cupy.cuda, "memory", None), "OutOfMemoryError", None)
        if oom is not None:
            try:
                total = memory_stats(device).get("device_total_bytes", 0)
                raise oom(size, total) from e
            except TypeError:
                pass
        raise
    owner = _Allocation(ptr, size, device, stream)
    return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ptr, size, owner, device), 0)


def install(conf: Optional[str] = None, lib_path: Optional[str] = None) -> None:
    """Makes cucache CuPy's allocator (for every device). conf: a CUCACHE_CONF string, checked
    and applied here (ValueError when it is not valid, RuntimeError when cucache already runs with
    another). Memory CuPy allocated before stays its pool's."""
    global _installed, _previous
    if _installed:
        _lib.configure(conf, "cucache.cupy.install", lib_path)  # refuses another conf
        return
    import cupy

    _lib.configure(conf, "cucache.cupy.install", lib_path)
    _previous = cupy.cuda.get_allocator() if hasattr(cupy.cuda, "get_allocator") else None
    cupy.cuda.set_allocator(allocator)
    _lib.set_current_device_function(lambda: int(cupy.cuda.runtime.getDevice()))
    _installed = True


def uninstall() -> None:
    """Gives CuPy back the allocator it had before install()."""
    global _installed
    if not _installed:
        return
    import cupy

    cupy.cuda.set_allocator(_previous)
    _installed = False


def installed() -> bool:
    return _installed
