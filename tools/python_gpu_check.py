#!/usr/bin/env python3
"""Proof of the cucache Python package on a GPU: CuPy, Numba (both ways of installing it) and,
where torch is installed, PyTorch programs on cucache, each in a process of its own, with their
results checked against NumPy and cucache's statistics showing their allocations.

    pip install . && python3 tools/python_gpu_check.py             # the installed package
    PYTHONPATH=python CUCACHE_LIB=build/lib/libcucache_torch.so python3 tools/python_gpu_check.py

Exit 0 when every available framework passed (one that is not installed is reported as skipped),
1 on any failure. Set CUCACHE_CONF to run them with a configuration (expandable_segments:True).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_PYTHON = Path(__file__).resolve().parent.parent / "python"


def _import_cucache():
    try:
        import cucache
    except ImportError:
        sys.path.insert(0, str(REPO_PYTHON))
        import cucache
    return cucache


def _check_stats(cucache, what: str, min_allocs: int) -> None:
    s = cucache.memory_stats(0)
    allocs = s["allocation.all.allocated"]
    print(f"{what}: cucache served {allocs} allocations, {s['num_device_alloc']} device allocations, "
          f"peak reserved {s['reserved_bytes.all.peak'] >> 20} MiB, backend {cucache.backend()}")
    assert cucache.backend() == "cuda", cucache.backend()
    assert allocs >= min_allocs, f"{what}: only {allocs} allocations went through cucache"
    assert cucache.bad_free_count() == 0, cucache.bad_free_count()


def run_cupy() -> None:
    cucache = _import_cucache()
    import cucache.cupy
    import numpy as np

    cucache.cupy.install()
    import cupy as cp

    x = cp.arange(10_000_000, dtype=cp.float32)
    y = 2.0 * x + 1.0
    np.testing.assert_allclose(cp.asnumpy(y), 2.0 * np.arange(10_000_000, dtype=np.float32) + 1.0)
    a = cp.random.rand(1024, 512, dtype=cp.float32)
    b = cp.random.rand(512, 256, dtype=cp.float32)
    c = a @ b
    np.testing.assert_allclose(cp.asnumpy(c), cp.asnumpy(a) @ cp.asnumpy(b), rtol=1e-4)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        for i in range(200):  # many temporaries of many sizes, on a stream of their own
            t = cp.full(1000 + 37 * i, i, dtype=cp.float64)
            assert float(t.sum()) == i * (1000 + 37 * i)
    s.synchronize()
    del x, y, a, b, c, t
    assert cp.get_default_memory_pool().used_bytes() == 0, "CuPy's own pool was used"
    _check_stats(cucache, "cupy", 200)
    print(cucache.memory_summary(0))


NUMBA_KERNEL = """
from numba import cuda
@cuda.jit
def saxpy(a, x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]
"""


def run_numba(via_env: bool) -> None:
    cucache = _import_cucache()
    import cucache.numba
    import numpy as np

    if not hasattr(np, "row_stack"):
        # numba 0.68's typing of NumPy still names np.row_stack, which NumPy 2.4 removed: without
        # this alias every @cuda.jit compile fails with AttributeError, cucache or not (seen on the
        # H200's torch venv). An environment mismatch, not part of what this check proves.
        np.row_stack = np.vstack
    if not via_env:
        cucache.numba.install()
    from numba import cuda

    ns: dict = {}
    exec(NUMBA_KERNEL, ns)
    saxpy = ns["saxpy"]
    n = 1 << 22
    x = np.arange(n, dtype=np.float32)
    y = np.ones(n, dtype=np.float32)
    for _ in range(20):
        dx, dy = cuda.to_device(x), cuda.to_device(y)
        out = cuda.device_array_like(dx)
        saxpy[(n + 255) // 256, 256](np.float32(3.0), dx, dy, out)
        np.testing.assert_array_equal(out.copy_to_host(), 3.0 * x + y)
        del dx, dy, out
    cuda.current_context().deallocations.clear()
    mgr = cuda.current_context().memory_manager
    assert type(mgr).__name__ == "CucacheMemoryManager", type(mgr)
    info = cuda.current_context().get_memory_info()
    assert 0 < info.free <= info.total, info
    _check_stats(cucache, "numba (NUMBA_CUDA_MEMORY_MANAGER)" if via_env else "numba (install())", 60)
    left = cucache.memory_stats(0)["allocated_bytes.all.current"]
    print(f"numba: {left} bytes still allocated after the arrays were dropped (expected 0)")


def run_torch() -> None:
    cucache = _import_cucache()
    import cucache.torch

    cucache.torch.install(hooks=False)
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    b = torch.randn(2048, 2048, device="cuda")
    c = a @ b
    torch.testing.assert_close(c.cpu(), a.cpu() @ b.cpu(), rtol=1e-3, atol=1e-2)
    for i in range(100):
        t = torch.full((1000 + 13 * i,), float(i), device="cuda")
        assert float(t.sum()) == i * (1000 + 13 * i)
    torch.cuda.synchronize()
    _check_stats(cucache, "torch", 100)


MODES = {
    "cupy": (run_cupy, "cupy", {}),
    "numba-install": (lambda: run_numba(False), "numba", {}),
    "numba-env": (lambda: run_numba(True), "numba", {"NUMBA_CUDA_MEMORY_MANAGER": "cucache.numba"}),
    "torch": (run_torch, "torch", {}),
}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        MODES[sys.argv[2]][0]()
        print(f"python_gpu_check {sys.argv[2]}: OK")
        return 0
    status = 0
    for mode, (_, module, env) in MODES.items():
        try:
            __import__(module)
        except ImportError as e:
            print(f"python_gpu_check {mode}: SKIPPED ({module} is not installed: {e})")
            continue
        child_env = dict(os.environ, CUCACHE_BACKEND="cuda", **env)
        r = subprocess.run([sys.executable, __file__, "--child", mode], env=child_env)
        print(f"python_gpu_check {mode}: {'OK' if r.returncode == 0 else f'FAILED (exit {r.returncode})'}")
        status |= r.returncode != 0
    return status


if __name__ == "__main__":
    sys.exit(main())
