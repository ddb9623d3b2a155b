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
    prepare_sleep,
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
    "prepare_sleep",
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


# PyTorch keys that are not cucache's concern: accepted, left to torch, said once.
_TORCH_ONLY_IGNORED = {
    "pinned_use_cuda_host_register": "concerns torch's pinned host allocator, which stays torch's",
    "pinned_num_register_threads": "concerns torch's pinned host allocator, which stays torch's",
    "pinned_use_background_threads": "concerns torch's pinned host allocator, which stays torch's",
    "pinned_reserve_segment_size_mb": "concerns torch's pinned host allocator, which stays torch's",
    "throw_on_cudamalloc_oom": "cucache always raises torch.OutOfMemoryError when out of memory",
    "release_lock_on_cudamalloc": "cucache never holds a lock across the device call of another stream",
    "graph_capture_record_stream_reuse": "cucache retains blocks used on a capturing stream for the graph",
}


def _warn(msg: str) -> None:
    import sys

    print(f"cucache: {msg}", file=sys.stderr)


def torch_conf_to_cucache(text: str, variable: str) -> str:
    """PYTORCH_ALLOC_CONF's text as a CUCACHE_CONF: the keys the two share pass (cucache's parser
    checks them: ValueError naming a key cucache does not support, and the variable); torch's
    host-allocator keys and the ones cucache satisfies by design are dropped with a line saying
    so; backend:cudaMallocAsync is refused (cucache is the allocator)."""
    kept = []
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        key, _, value = entry.partition(":")
        key = key.strip()
        if key in _TORCH_ONLY_IGNORED:
            _warn(f"{variable}: {key} ignored: {_TORCH_ONLY_IGNORED[key]}")
            continue
        if key == "backend":
            if value.strip() != "native":
                raise ValueError(
                    f"{variable}: backend:{value.strip()} asks for another CUDA allocator than "
                    "cucache; drop it, or do not install cucache"
                )
            continue
        kept.append(f"{key}:{value}")
    conf = ",".join(kept)
    try:
        _lib.canonical_conf(conf)
    except ValueError as e:
        raise ValueError(f"{variable}={text!r} cannot configure cucache: {e}") from None
    return conf


def _settings(conf: Optional[str]) -> Optional[str]:
    """The one rule for settings: install(conf=...) or CUCACHE_CONF configure cucache; without
    either, PYTORCH_ALLOC_CONF (else PYTORCH_CUDA_ALLOC_CONF) does, translated; when both are set
    and differ, CUCACHE_CONF wins and one line says so."""
    torch_var = next((v for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF") if os.environ.get(v)), None)
    own = conf if conf is not None else os.environ.get("CUCACHE_CONF")
    if torch_var is None:
        return conf
    if own is not None:
        if own.replace(" ", "") != os.environ[torch_var].replace(" ", ""):
            _warn(f"both CUCACHE_CONF ({own!r}) and {torch_var} ({os.environ[torch_var]!r}) are set: cucache uses CUCACHE_CONF")
        return conf
    return torch_conf_to_cucache(os.environ[torch_var], torch_var)


def _torch_version(torch: Any) -> str:
    return str(torch.__version__).split("+")[0]


def _cache_dir(torch: Any) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cucache" / f"torch-{getattr(torch, '__version__', 'unknown')}"


def _load_hooks(path: Path, torch: Any) -> ctypes.CDLL:
    """Loads the extension; a library built for another torch is a clear error."""
    try:
        hl = ctypes.CDLL(str(path))
    except OSError as e:
        raise RuntimeError(
            f"cucache: {path} does not load with torch {torch.__version__} ({e}): it was built for "
            f"another torch; rebuild it: bash tools/build_torch_hooks.sh"
        ) from None
    hl.cucache_torch_hooks_torch_version.restype = ctypes.c_char_p
    built = hl.cucache_torch_hooks_torch_version().decode()
    if built != _torch_version(torch):
        raise RuntimeError(
            f"cucache: {path} was built against torch {built}, this process runs torch "
            f"{torch.__version__}: rebuild it (bash tools/build_torch_hooks.sh, or delete it and "
            f"install() builds one into {_cache_dir(torch)})"
        )
    return hl


def _build_hooks(torch: Any, lib_file: str) -> Optional[Path]:
    """Builds the extension into the per-torch cache folder from the source tree, with a progress
    line; None when there is no source tree or no compiler (the caller says what to run)."""
    import shutil
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    script = repo / "tools" / "build_torch_hooks.sh"
    if not script.is_file() or shutil.which(os.environ.get("CXX", "g++")) is None:
        return None
    out = _cache_dir(torch)
    print(f"cucache: building the torch extension for torch {torch.__version__} into {out} (once, about a minute) ...",
          file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHON=sys.executable)
    r = subprocess.run(["bash", str(script), str(Path(lib_file).parent), str(out)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"cucache: building the torch extension failed:\n{r.stderr[-4000:]}")
    print("cucache: torch extension built", file=sys.stderr, flush=True)
    return out / _HOOKS_NAME


def _find_hooks(torch: Any, lib_file: str, hooks: Optional[bool]) -> Optional[Path]:
    if hooks is False:
        return None
    explicit = os.environ.get("CUCACHE_TORCH_HOOKS_LIB")
    if explicit:
        return Path(explicit)
    for c in (Path(lib_file).with_name(_HOOKS_NAME), _cache_dir(torch) / _HOOKS_NAME):
        if c.is_file():
            return c
    built = _build_hooks(torch, lib_file)
    if built is not None:
        return built
    how = ("build it where torch is importable: cmake -S . -B build -DCUCACHE_TORCH_DIR=$(python3 -c "
           "'import torch, os; print(os.path.dirname(torch.__file__))') && cmake --build build --target "
           "cucache_torch_hooks (or bash tools/build_torch_hooks.sh build/lib)")
    if hooks:
        raise FileNotFoundError(f"cucache: the torch extension ({_HOOKS_NAME}) is missing; {how}")
    _warn(f"the torch extension ({_HOOKS_NAME}) is missing, using the plain CUDAPluggableAllocator "
          f"(no CUDA-graph pools, IPC, history, torch.cuda.memory_stats); {how}")
    return None


def install(lib_path: Optional[str] = None, conf: Optional[str] = None, hooks: Optional[bool] = None) -> None:
    """Makes cucache PyTorch's CUDA allocator. Call before anything allocates CUDA memory.

    conf: a CUCACHE_CONF string (docs/config.md), checked here (ValueError naming the key when it
    is not valid) and set in the environment; without it, CUCACHE_CONF from the environment, else
    PYTORCH_ALLOC_CONF / PYTORCH_CUDA_ALLOC_CONF translated (docs/torch.md, "Settings"). The
    configuration is the process's from then on: a second install() with another conf raises
    RuntimeError. hooks: the torch extension (libcucache_torch_hooks.so: cucache as a complete
    CUDAAllocator); None = use it when found or buildable (it is built on first use into
    ~/.cache/cucache/torch-VERSION), else the plain CUDAPluggableAllocator with a warning; True =
    require it; False = the plain plug-in.
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
    _lib.library(lib_path)
    _lib.configure(_settings(conf), "cucache.torch.install", lib_path)
    lib_file = _lib.library_path()
    hooks_path = _find_hooks(torch, lib_file or "", hooks)
    if hooks_path is not None:
        if not hooks_path.is_file():
            raise FileNotFoundError(f"cucache: the torch extension {hooks_path} is missing")
        hl = _load_hooks(hooks_path, torch)
        hl.cucache_torch_hooks_install.restype = ctypes.c_int
        _check(hl.cucache_torch_hooks_install(), "installing the torch extension")
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


