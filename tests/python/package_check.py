"""Checks the cucache Python package on the simulated device (CUCACHE_BACKEND=sim) with fake cupy
and numba modules (neither is needed): the shared registry and statistics API, cucache.cupy's
allocator and owner-frees, cucache.numba's EMM plug-in (also through NUMBA_CUDA_MEMORY_MANAGER's
lookup), and cucache.torch importing without torch. Run from the source tree (ctest, PYTHONPATH=
python) or against an installed wheel (CI, CUCACHE_EXPECT_INSTALLED=1)."""

from __future__ import annotations

import ctypes
import gc
import importlib
import os
import sys
import tempfile
import textwrap
from pathlib import Path

os.environ["CUCACHE_BACKEND"] = "sim"
os.environ["CUCACHE_CONF"] = "memory_limit:512MiB"
MIB = 1 << 20

FAKE_CUPY = {
    "cupy/__init__.py": "from . import cuda\n",
    "cupy/cuda/__init__.py": textwrap.dedent(
        """
        from . import runtime, memory
        _allocator = None
        def set_allocator(f):
            global _allocator
            _allocator = f
        def get_allocator():
            return _allocator
        class UnownedMemory:
            def __init__(self, ptr, size, owner, device_id=-1):
                self.ptr, self.size, self._owner, self.device_id = ptr, size, owner, device_id
        class MemoryPointer:
            def __init__(self, mem, offset):
                self.mem, self.ptr = mem, mem.ptr + offset
        class _Stream:
            ptr = 0x4200
        def get_current_stream():
            return _Stream()
        """
    ),
    "cupy/cuda/runtime.py": "def getDevice():\n    return 0\n",
    "cupy/cuda/memory.py": textwrap.dedent(
        """
        class OutOfMemoryError(MemoryError):
            def __init__(self, size, total, limit=0):
                super().__init__(f"Out of memory allocating {size:,} bytes")
                self.size = size
        """
    ),
}

FAKE_NUMBA = {
    "numba/__init__.py": "from . import cuda\n",
    "numba/core/__init__.py": "",
    # As numba-cuda 0.30.4 on the H200: the config says 0, the driver has no USE_NV_BINDING flag,
    # always uses NVIDIA's binding and calls int() on a MemoryPointer's pointer.
    "numba/core/config.py": "CUDA_USE_NVIDIA_BINDING = 0\n",
    "numba/cuda/cudadrv/__init__.py": "",
    "numba/cuda/cudadrv/driver.py": textwrap.dedent(
        """
        class CUdeviceptr:
            def __init__(self, value=0):
                if not isinstance(value, int):
                    raise TypeError("CUdeviceptr takes an int")
                self._value = value
            def __int__(self):
                return self._value
        class binding:
            CUdeviceptr = CUdeviceptr
        """
    ),
    "numba/cuda/__init__.py": textwrap.dedent(
        """
        from collections import namedtuple
        MemoryInfo = namedtuple("MemoryInfo", "free total")
        class BaseCUDAMemoryManager:
            def __init__(self, context):
                self.context = context
            def initialize(self):
                pass
        class HostOnlyCUDAMemoryManager(BaseCUDAMemoryManager):
            pass
        class MemoryPointer:
            def __init__(self, context, pointer, size, owner=None, finalizer=None):
                self.context, self.device_pointer, self.size = context, pointer, size
                self._finalizer = finalizer
            def free(self):
                self._finalizer()
        _manager = None
        def set_memory_manager(cls):
            global _manager
            _manager = cls
        class _Device:
            id = 0
        def get_current_device():
            return _Device()
        """
    ),
}


def write_fakes(root: Path) -> None:
    for files in (FAKE_CUPY, FAKE_NUMBA):
        for name, text in files.items():
            p = root / name
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="cucache-fakes-") as fakes:
        write_fakes(Path(fakes))
        sys.path.insert(0, fakes)
        return check()


def check() -> int:
    import cucache

    assert cucache.backend() == "sim", cucache.backend()
    if os.environ.get("CUCACHE_EXPECT_INSTALLED") == "1":
        pkg = Path(cucache.__file__).resolve().parent
        assert Path(cucache.library_path()).resolve().parent == pkg, (cucache.library_path(), pkg)
        assert Path(cucache.preload_library()).is_file()
    base = cucache.memory_stats(0)["allocated_bytes.all.current"]

    # --- CuPy -------------------------------------------------------------------------------
    import cupy

    import cucache.cupy as cc

    cc.install()
    assert cupy.cuda.get_allocator() is cc.allocator
    mp = cupy.cuda.get_allocator()(3 * MIB)
    assert mp.ptr != 0 and mp.mem.size == 3 * MIB
    s = cucache.memory_stats()
    assert s["allocated_bytes.all.current"] == base + 3 * MIB, s["allocated_bytes.all.current"]
    snap = cucache.snapshot()
    live = [b for seg in snap["segments"] for b in seg["blocks"] if b["state"] == "active_allocated"]
    assert mp.ptr in [b["address"] for b in live], live
    assert "Allocated memory" in cucache.memory_summary()
    zero = cc.allocator(0)
    assert zero.ptr == 0
    try:
        cc.allocator(1024 * MIB)
    except cupy.cuda.memory.OutOfMemoryError as e:
        assert e.size == 1024 * MIB
    else:
        raise AssertionError("an allocation over the memory limit succeeded")
    del mp
    gc.collect()
    assert cucache.memory_stats()["allocated_bytes.all.current"] == base, "the owner did not free"
    assert cucache.bad_free_count() == 0
    cc.uninstall()
    assert cupy.cuda.get_allocator() is None

    # --- Numba ------------------------------------------------------------------------------
    from numba import cuda

    mod = importlib.import_module("cucache.numba")  # what NUMBA_CUDA_MEMORY_MANAGER does
    mgr_cls = mod._numba_memory_manager
    assert issubclass(mgr_cls, cuda.BaseCUDAMemoryManager)
    mod.install()
    assert cuda._manager is mgr_cls

    class Context:
        class device:
            id = 0

    mgr = mgr_cls(context=Context())
    mgr.initialize()
    assert mgr.interface_version == 1
    a = mgr.memalloc(2 * MIB)
    b = mgr.memalloc(1000)
    from numba.cuda.cudadrv import driver

    assert isinstance(a.device_pointer, driver.CUdeviceptr), type(a.device_pointer)
    assert int(a.device_pointer) != 0
    driver.USE_NV_BINDING = False  # a Numba with its own ctypes binding selected
    d = mgr.memalloc(4096)
    assert isinstance(d.device_pointer, ctypes.c_uint64) and d.device_pointer.value != 0
    d.free()
    del driver.USE_NV_BINDING
    s = cucache.memory_stats(0)
    assert s["allocated_bytes.all.current"] == base + 2 * MIB + 1024, s["allocated_bytes.all.current"]
    info = mgr.get_memory_info()
    assert info.total == 512 * MIB and 0 < info.free <= info.total, info
    try:
        mgr.get_ipc_handle(a)
    except RuntimeError as e:
        assert "IPC" in str(e)
    else:
        raise AssertionError("get_ipc_handle did not refuse")
    # One registry: CuPy's and Numba's memory in the same statistics.
    c = mgr.memalloc(3 * MIB)
    for m in (a, b, c):
        m.free()
    assert cucache.memory_stats(0)["allocated_bytes.all.current"] == base
    mgr.reset()
    assert cucache.memory_stats(0)["reserved_bytes.all.current"] == 0

    # --- headroom and reserve ---------------------------------------------------------------
    n = cucache.max_allocatable()
    assert isinstance(n, int) and n > 0, n
    p = cucache.alloc(n, 0)  # exactly the headroom is served
    cucache.free(p, n, 0)
    assert cucache.max_allocatable(0) == n, (cucache.max_allocatable(0), n)
    before = cucache.memory_stats()["reserved_bytes.all.current"]
    cucache.empty_cache()
    cucache.reserve(64 * MIB)
    after = cucache.memory_stats()["reserved_bytes.all.current"]
    assert after == cucache.memory_stats()["reserved_bytes.all.current"]
    assert after >= 64 * MIB and after <= before + 64 * MIB, (before, after)
    for bad, err in ((-1, ValueError), (1 << 60, RuntimeError)):
        try:
            cucache.reserve(bad)
        except err:
            pass
        else:
            raise AssertionError(f"cucache.reserve({bad}) was accepted")

    # --- torch: importable without torch; install() needs it -----------------------------------
    import cucache.torch as ct

    assert ct.memory_stats is cucache.memory_stats
    try:
        import torch  # noqa: F401
    except ImportError:
        try:
            ct.install()
        except ImportError:
            pass
        else:
            raise AssertionError("cucache.torch.install() without torch")
    print("package_check: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
