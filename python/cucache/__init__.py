"""cucache from Python: one caching allocator (one registry, in the plug-in library
libcucache_torch.so) behind PyTorch, CuPy and Numba, and one statistics API.

    import cucache.torch; cucache.torch.install()      # PyTorch (before any CUDA allocation)
    import cucache.cupy;  cucache.cupy.install()       # CuPy
    import cucache.numba; cucache.numba.install()      # Numba (or NUMBA_CUDA_MEMORY_MANAGER=cucache.numba)

    print(cucache.memory_summary())
    cucache.memory_stats()["allocated_bytes.all.current"]

    cucache.fit("snapshot.pickle", capacity_gib=24)["fits"]   # will a recorded job fit? (no GPU)

No framework is imported until its install() runs. CUCACHE_CONF configures the allocator
(docs/config.md); CUCACHE_BACKEND=sim runs it on the simulated device. See docs/python.md.
"""

from __future__ import annotations

from ._fit import fit
from ._lib import (
    alloc,
    backend,
    bad_free_count,
    canonical_conf,
    dump_snapshot,
    empty_cache,
    free,
    last_error,
    leak_report,
    library,
    library_path,
    max_allocatable,
    memory_stats,
    memory_summary,
    metrics_text,
    load_snapshot,
    make_sleepable,
    prepare_sleep,
    mark_step,
    pop_tag,
    push_tag,
    reserve,
    reset_peak_memory_stats,
    sleep,
    set_tag_limit,
    sleeping,
    snapshot,
    snapshot_json,
    tag,
    tag_backward,
    tag_limit,
    tag_stats,
    wake,
)

__version__ = "0.1.0"

__all__ = [
    "alloc",
    "backend",
    "bad_free_count",
    "canonical_conf",
    "dump_snapshot",
    "empty_cache",
    "fit",
    "free",
    "last_error",
    "leak_report",
    "library",
    "library_path",
    "load_snapshot",
    "make_sleepable",
    "prepare_sleep",
    "mark_step",
    "max_allocatable",
    "memory_stats",
    "memory_summary",
    "metrics_text",
    "pop_tag",
    "preload_library",
    "push_tag",
    "reserve",
    "reset_peak_memory_stats",
    "set_tag_limit",
    "sleep",
    "sleeping",
    "snapshot",
    "snapshot_json",
    "tag",
    "tag_backward",
    "tag_limit",
    "tag_stats",
    "wake",
]


def preload_library() -> str:
    """The path of libcucache_preload.so shipped with the package, for LD_PRELOAD of an
    unmodified CUDA program (docs/preload.md)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for p in (here / "libcucache_preload.so", here.parent.parent / "build" / "lib" / "libcucache_preload.so"):
        if p.is_file():
            return str(p)
    raise FileNotFoundError("cucache: libcucache_preload.so is not part of this installation")
