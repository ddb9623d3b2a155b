"""cucache as Numba's CUDA memory manager (an External Memory Management plug-in).

    import cucache.numba
    cucache.numba.install()        # before Numba creates its CUDA context

or, with no code change:

    NUMBA_CUDA_MEMORY_MANAGER=cucache.numba python program.py

Device allocations (cuda.device_array, to_device, ...) are cucache memory on the context's device,
on the legacy default stream (Numba's memalloc carries no stream), freed when Numba finalizes the
array; host and pinned memory stay Numba's (HostOnlyCUDAMemoryManager). IPC handles of cucache
memory are refused (a handle would name a whole cucache segment). numba is imported only when the
manager class is first needed. See docs/python.md.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any, Optional

from . import _lib
from ._lib import memory_stats, memory_summary, snapshot  # noqa: F401  (the shared API)

__all__ = ["install", "CucacheMemoryManager", "memory_stats", "memory_summary", "snapshot"]

_class: Any = None


def _numba_config() -> Any:
    try:
        from numba.cuda.core import config  # numba-cuda's own config, where it has one
    except ImportError:
        from numba.core import config
    return config


def _device_pointer(ptr: int) -> Any:
    """The pointer object Numba's MemoryPointer takes: the driver binding's own CUdeviceptr where
    the driver uses NVIDIA's cuda-python binding, a ctypes integer with Numba's ctypes binding.

    numba-cuda releases without the ctypes binding have no USE_NV_BINDING flag and always use
    NVIDIA's binding -- while their config may still say CUDA_USE_NVIDIA_BINDING = 0 (numba-cuda
    0.30.4 on the H200 does) -- and their MemoryPointer calls int() on the pointer: so the driver
    module decides, never the config. Without a driver module the config's flag decides."""
    try:
        from numba.cuda.cudadrv import driver
    except ImportError:
        driver = None
    if driver is not None:
        flag = getattr(driver, "USE_NV_BINDING", None)
        nvidia = True if flag is None else bool(flag)
    else:
        nvidia = bool(getattr(_numba_config(), "CUDA_USE_NVIDIA_BINDING", False))
    if not nvidia:
        return ctypes.c_uint64(ptr)
    cls = getattr(getattr(driver, "binding", None), "CUdeviceptr", None)
    if cls is None:
        try:
            from cuda.bindings.driver import CUdeviceptr as cls
        except ImportError:
            from cuda.cuda import CUdeviceptr as cls
    return cls(ptr)


def _make_class() -> Any:
    from numba import cuda

    try:
        from numba.cuda import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
    except ImportError:
        from numba.cuda.cudadrv.driver import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer

    class CucacheMemoryManager(HostOnlyCUDAMemoryManager):
        """Numba EMM plug-in over cucache (a BaseCUDAMemoryManager through
        HostOnlyCUDAMemoryManager, which keeps host allocations Numba's)."""

        def initialize(self) -> None:
            super().initialize()
            _lib.library()
            _lib.set_current_device_function(lambda: int(cuda.get_current_device().id))

        def _device(self) -> int:
            dev = getattr(self.context, "device", None)
            return int(getattr(dev, "id", 0)) if dev is not None else 0

        def memalloc(self, size: int) -> Any:
            device = self._device()
            ptr = _lib.alloc(size, device, 0)

            def finalizer(ptr: int = ptr, size: int = size, device: int = device) -> None:
                _lib._release(ptr, size, device, 0)

            return MemoryPointer(self.context, _device_pointer(ptr), size, finalizer=finalizer)

        def get_memory_info(self) -> Any:
            s = memory_stats(self._device())
            total = s["memory_limit"] or s["device_total_bytes"]
            free = max(total - s["active_bytes.all.current"], 0)
            return MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory: Any) -> Any:
            raise RuntimeError(
                "cucache.numba: IPC handles of cucache memory are not supported: a handle would "
                "name the whole cucache segment, not this allocation (docs/python.md)"
            )

        def reset(self) -> None:
            _lib.empty_cache()

        def defer_cleanup(self) -> Any:
            return contextlib.nullcontext()

        @property
        def interface_version(self) -> int:
            return 1

    return CucacheMemoryManager


def __getattr__(name: str) -> Any:
    # NUMBA_CUDA_MEMORY_MANAGER=cucache.numba makes Numba read _numba_memory_manager; the class
    # needs numba's base class, so it is made on that first access, not at import.
    global _class
    if name in ("_numba_memory_manager", "CucacheMemoryManager"):
        if _class is None:
            _class = _make_class()
        return _class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(conf: Optional[str] = None, lib_path: Optional[str] = None) -> None:
    """Makes cucache Numba's CUDA memory manager. Call before Numba creates its context (the
    first cuda.* call that touches the GPU). conf: a CUCACHE_CONF string, checked and
    applied here (ValueError when it is not valid, RuntimeError when cucache already runs with
    another)."""
    from numba import cuda

    _lib.configure(conf, "cucache.numba.install", lib_path)
    cuda.set_memory_manager(__getattr__("_numba_memory_manager"))
