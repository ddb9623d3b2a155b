"""The plug-in library (libcucache_torch.so) through ctypes: one registry for every Python front
end (cucache.torch, cucache.cupy, cucache.numba), and the statistics API they share. No framework
is imported here."""

from __future__ import annotations

import contextlib
import ctypes
import json
import operator
import os
import pickle
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

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
    "take_back_count",
    "vm_map_count",
    "vm_unmap_count",
    "stitched_pages",
    "shared_pages",
    "vm_sync_count",
    "vm_split_count",
    "vm_reclaim_count",
    "vm_host_ns",
    "sync_host_ns",
    "mapped_bytes",
    "unmapped_handle_bytes",
    "free_bytes",
    "free_block_count",
    "largest_free_block",
    "memory_limit",
    "device_total_bytes",
    "sleeping_bytes",
    "sleeping_host_bytes",
)


class _Stats(ctypes.Structure):
    # Mirrors cucache_torch_stats (src/integrations/torch/cucache_torch.h), the field table of
    # include/cucache/stats.hpp flattened; checked on load against the library's own description
    # (cucache_torch_stats_layout: names, order, offsets, sizes, types).
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
    # A variable that names a library is the user's choice: a wrong path is an error, never a fall
    # back to another copy (beside the package or in build/lib) that may be a different build.
    for var in ("CUCACHE_LIB", "CUCACHE_TORCH_LIB"):
        env = os.environ.get(var)
        if env:
            if not Path(env).is_file():
                raise FileNotFoundError(f"cucache: {var}={env}: no such file (unset {var} to use the "
                                        f"{_LIB_NAME} beside the package or in build/lib)")
            break
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
        "cucache_torch_free_checked": (i, [vp, sz, i, vp]),
        "cucache_torch_record_stream": (i, [vp, vp]),
        "cucache_torch_empty_cache": (i, []),
        "cucache_torch_max_allocatable": (i, [i, ctypes.POINTER(sz)]),
        "cucache_torch_reserve": (i, [i, sz]),
        "cucache_torch_reset_peak_stats": (i, [i]),
        "cucache_torch_reset_accumulated_stats": (i, [i]),
        "cucache_torch_set_memory_fraction": (i, [i, ctypes.c_double]),
        "cucache_torch_get_stats": (i, [i, ctypes.POINTER(_Stats)]),
        "cucache_torch_stats_size": (sz, []),
        "cucache_torch_stats_layout": (ctypes.c_char_p, []),
        "cucache_torch_memory_summary": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_snapshot_json": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_write_snapshot": (i, [ctypes.c_char_p]),
        "cucache_torch_mark_step": (i, []),
        "cucache_torch_leak_report": (i64, [u64, ctypes.c_char_p, sz]),
        "cucache_torch_push_tag": (i, [ctypes.c_char_p]),
        "cucache_torch_pop_tag": (i, []),
        "cucache_torch_tag_stats": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_set_tag_limit": (i, [i, ctypes.c_char_p, u64]),
        "cucache_torch_tag_limit": (i, [i, ctypes.c_char_p, ctypes.POINTER(u64)]),
        "cucache_torch_metrics": (i64, [ctypes.c_char_p, sz]),
        "cucache_torch_make_sleepable": (i, [ctypes.c_char_p]),
        "cucache_torch_sleep": (i, [i, ctypes.c_char_p, i]),
        "cucache_torch_prepare_sleep": (i, [i, ctypes.c_char_p, u64, ctypes.POINTER(u64)]),
        "cucache_torch_wake": (i, [i, ctypes.c_char_p, ctypes.POINTER(ctypes.c_double)]),
        "cucache_torch_sleeping": (i64, [i, ctypes.c_char_p, sz]),
        "cucache_torch_sleep_tags": (
            i,
            [i, ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int), sz],
        ),
        "cucache_torch_wake_tags": (
            i,
            [i, ctypes.POINTER(ctypes.c_char_p), sz, ctypes.POINTER(ctypes.c_double)],
        ),
        "cucache_torch_last_error": (ctypes.c_char_p, []),
        "cucache_torch_last_alloc_error": (i, []),
        "cucache_torch_bad_free_count": (u64, []),
        "cucache_torch_backend_name": (ctypes.c_char_p, []),
        "cucache_torch_check_device": (i, [i]),
        "cucache_torch_device_count": (i, []),
        "cucache_torch_canonical_conf": (i64, [ctypes.c_char_p, ctypes.c_char_p, sz]),
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
        mismatch = layout_mismatch(lib)
        if mismatch:
            raise RuntimeError(f"cucache: {path} and this module do not match: {mismatch}")
        _lib, _lib_path = lib, str(path)
    return _lib


_CTYPE_NAMES = {_Stat * 3: "stat[3]", ctypes.c_uint64: "u64", ctypes.c_double: "f64"}


def stats_layout() -> list[tuple[str, int, int, str]]:
    """This module's ctypes layout of cucache_torch_stats: (name, offset, size, type) per field."""
    return [(n, getattr(_Stats, n).offset, getattr(_Stats, n).size, _CTYPE_NAMES[t]) for n, t in _Stats._fields_]


def library_stats_layout(lib: ctypes.CDLL) -> list[tuple[str, int, int, str]]:
    """The library's cucache_torch_stats layout, from its field table (cucache_torch_stats_layout)."""
    rows = []
    for line in lib.cucache_torch_stats_layout().decode().splitlines():
        name, offset, size, kind = line.split()
        rows.append((name, int(offset), int(size), kind))
    return rows


def layout_mismatch(lib: ctypes.CDLL) -> str:
    """"" when this module's stats layout is the library's, else the first difference."""
    if lib.cucache_torch_stats_size() != ctypes.sizeof(_Stats):
        return f"stats struct of {lib.cucache_torch_stats_size()} bytes, module expects {ctypes.sizeof(_Stats)}"
    mine, theirs = stats_layout(), library_stats_layout(lib)
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return f"stats field {i}: module has {a}, library has {b}"
    return ""


def last_error() -> str:
    return (library().cucache_torch_last_error() or b"").decode(errors="replace")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(_error(what))


def _error(what: str) -> str:
    """The message of the latest error of call `what`, with one prefix: "cucache: sleep: why",
    not "cucache: sleep failed: cucache_torch: sleep: cucache: sleep: why" (each C layer names the
    library and the call, and so did this module). A text that names the call itself
    ("free(0x...) on device 0: ...") gets no second name."""
    why = _why(what)
    return f"cucache: {why}" if why.startswith(f"{what}(") else f"cucache: {what}: {why}"


def library_path() -> Optional[str]:
    """The plug-in library loaded, or None before the first use."""
    return _lib_path


def set_current_device_function(fn: Any) -> None:
    """The front end's current device (a callable returning an int), for calls without device=."""
    global _current_device
    _current_device = fn


_INT_MAX = 2**31 - 1  # the C API's `int device`
_SIZE_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_size_t)) - 1
_PTR_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_void_p)) - 1


def _current() -> int:
    return int(_current_device()) if _current_device is not None else 0


def _device(device: Any) -> int:
    """The device index of `device`, as torch.cuda reads one: None or 'cuda' (the current
    device), an int, 'cuda:N', a torch.device of type 'cuda', or an object with an int `id`
    (cupy.cuda.Device, Numba's device). ValueError for a device that is not a CUDA one,
    RuntimeError for a negative index or one outside the C API's range (as torch raises for a
    device that does not exist); TypeError for anything else."""
    if device is None:
        index = _current()
    elif isinstance(device, str):
        text = device.strip()
        if text == "cuda":
            index = _current()
        elif text.startswith("cuda:") and text[5:].isdigit():
            index = int(text[5:])
        else:
            raise ValueError(f"cucache: {device!r} is not a CUDA device (expected 'cuda' or 'cuda:N')")
    elif isinstance(device, bool):
        raise TypeError(f"cucache: device {device!r} is a bool, not a device")
    elif isinstance(getattr(device, "type", None), str):  # torch.device
        if device.type != "cuda":
            raise ValueError(f"cucache: {device!r} is not a CUDA device")
        index = _current() if device.index is None else int(device.index)
    elif hasattr(type(device), "__index__"):  # int, numpy integers
        index = operator.index(device)
    elif isinstance(getattr(device, "id", None), int):  # cupy.cuda.Device, Numba's device
        index = int(device.id)
    else:
        raise TypeError(
            f"cucache: cannot read a device from {device!r} ({type(device).__name__}); expected "
            "an int, 'cuda', 'cuda:N' or a torch.device"
        )
    if not 0 <= index <= _INT_MAX:
        raise RuntimeError(f"cucache: device {index} does not exist (a device index is 0 to {_INT_MAX})")
    return index


def _in_range(value: Any, what: str, top: int) -> int:
    """`value` as an int in [0, top]: ctypes would truncate a larger one silently."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"cucache: {what} must be an int, not {type(value).__name__}")
    v = operator.index(value)
    if not 0 <= v <= top:
        raise ValueError(f"cucache: {what} {v} is out of range (0 to {top})")
    return v


# cucache_torch_check_device's answers (cucache_torch.h).
_READY, _CONFIG_ERROR, _NO_CUDA, _INVALID_DEVICE = 0, 1, 2, 3
_ready_devices: set[int] = set()


def _ready(device: int) -> int:
    """`device` once cucache can serve it (checked once per device, building the registry from the
    environment at the first call). ValueError for a configuration error (CUCACHE_CONF,
    CUCACHE_BACKEND, CUCACHE_SIM_DEVICES); RuntimeError for a device that does not exist (as
    torch raises) and when no CUDA driver or device is usable."""
    if device in _ready_devices:
        return device
    rc = library().cucache_torch_check_device(device)
    if rc == _READY:
        _ready_devices.add(device)
        return device
    why = _why()
    if rc == _CONFIG_ERROR:
        raise ValueError(f"cucache: configuration error: {why}")
    if rc == _INVALID_DEVICE:
        n = library().cucache_torch_device_count()
        raise RuntimeError(
            f"cucache: device {device} does not exist: this process has {n} {backend()} "
            f"device{'' if n == 1 else 's'}" + (f" (0 to {n - 1})" if n > 1 else "")
        )
    if rc == _NO_CUDA:
        raise RuntimeError(
            f"cucache: no usable CUDA driver or device: {why}. The NVIDIA driver (libcuda.so.1) "
            "must be installed and as new as the CUDA runtime cucache was built with; "
            "CUCACHE_BACKEND=sim runs on the simulated device instead"
        )
    raise RuntimeError(f"cucache: {_why()}")


_configured_ok = False


# What the C layers put before an error's text: the library's name, then the call's.
_LAYER_PREFIXES = ("cucache_torch: configuration: ", "cucache_torch: ", "cucache: ")


def _why(what: str = "") -> str:
    """The latest error's text without the prefixes of the C layers it went through: the library
    names ("cucache_torch: ", "cucache: ") and, when `what` is given, that call's name ("sleep: ",
    "sleep failed: ", "free refused: "), however many times they are stacked."""
    why = last_error()
    prefixes = _LAYER_PREFIXES + ((f"{what}: ", f"{what} failed: ", f"{what} refused: ") if what else ())
    stripped = True
    while stripped:
        stripped = False
        for prefix in prefixes:
            if why.startswith(prefix):
                why = why[len(prefix):]
                stripped = True
    return why


def _configured() -> None:
    """Reads the environment's configuration once (ValueError naming the bad key, at the first
    use of a call that takes no device); the calls with a device check it in _ready."""
    global _configured_ok
    if not _configured_ok:
        canonical_conf()
        _configured_ok = True


def canonical_conf(conf: Optional[str] = None) -> str:
    """The canonical form of a CUCACHE_CONF text (what differs from the defaults, in a fixed
    order; ValueError naming the key when it is not valid), or with conf None that of the
    configuration this process's allocators use (read from the environment at the first use)."""
    if conf is not None and ("\0" in conf):
        raise ValueError("cucache: a configuration cannot contain a NUL character")
    arg = conf.encode() if conf is not None else None
    try:
        return _text(lambda _d, b, n: library().cucache_torch_canonical_conf(arg, b, n), 0, "configuration")
    except RuntimeError:
        where = f"configuration {conf!r}" if conf is not None else "configuration error"
        raise ValueError(f"cucache: {where}: {_why()}") from None


def backend() -> str:
    """"cuda", or "sim" on the simulated device (CUCACHE_BACKEND=sim)."""
    return (library().cucache_torch_backend_name() or b"").decode()


def configure(conf: Optional[str], who: str, lib_path: Optional[str] = None) -> None:
    """What every install(conf=...) does: loads the library, checks `conf` (ValueError naming the
    key), sets CUCACHE_CONF to it and reads the environment now (ValueError for a bad
    CUCACHE_CONF, CUCACHE_BACKEND or CUCACHE_SIM_DEVICES), so that no configuration error waits
    for the first allocation. The configuration is the process's from its first use on: a `conf`
    that differs from it raises RuntimeError, and the environment is left as it was."""
    library(lib_path)
    want = canonical_conf(conf) if conf is not None else None
    previous = os.environ.get("CUCACHE_CONF")
    if conf is not None:
        os.environ["CUCACHE_CONF"] = conf
    try:
        active = canonical_conf()
        if want is not None and want != active:
            raise RuntimeError(
                f"{who}(conf={conf!r}): cucache runs with the configuration {active!r} already "
                "(from an earlier install(), an earlier cucache call or CUCACHE_CONF), and it "
                "cannot change in a running process; pass the configuration once, to the first "
                "install() or in CUCACHE_CONF"
            )
    except BaseException:
        if conf is not None:
            if previous is None:
                os.environ.pop("CUCACHE_CONF", None)
            else:
                os.environ["CUCACHE_CONF"] = previous
        raise


def alloc(size: int, device: Any = None, stream: int = 0) -> int:
    """size bytes on device for use on stream (a cudaStream_t as an int); 0 for size 0. Raises
    MemoryError (with cucache's message) when cucache cannot allocate, ValueError for a size or
    stream out of range, a configuration error or a misuse cucache refuses (an allocation under a
    sleeping tag), RuntimeError for a device that does not exist, when CUDA is unusable or the
    device fails."""
    size = _in_range(size, "alloc: size", _SIZE_MAX)
    stream = _in_range(stream, "alloc: stream", _PTR_MAX)
    d = _ready(_device(device))
    if size == 0:
        return 0
    p = library().cucache_torch_alloc(size, d, ctypes.c_void_p(stream or None))
    if not p:
        why = f"cucache: cannot allocate {size} bytes on device {d}: {_why('alloc')}"
        kind = library().cucache_torch_last_alloc_error()
        if kind == _ALLOC_INVALID_ARGUMENT:
            raise ValueError(why)
        if kind == _ALLOC_OTHER_ERROR:
            raise RuntimeError(why)
        raise MemoryError(why)
    return int(p)


_ALLOC_INVALID_ARGUMENT = 2  # cucache_torch.h: CUCACHE_TORCH_ALLOC_INVALID_ARGUMENT
_ALLOC_OTHER_ERROR = 3  # CUCACHE_TORCH_ALLOC_OTHER_ERROR


def free(ptr: int, size: int, device: Any = None, stream: int = 0) -> None:
    """Returns memory from alloc(). A stream other than the allocation's orders the free on it.
    RuntimeError with cucache's message, nothing changed, for a free cucache refuses -- a
    pointer it did not allocate, one freed already, an interior pointer -- as torch's allocator
    raises for one (it is counted in bad_free_count() too). 0 is a no-op."""
    ptr = _in_range(ptr, "free: pointer", _PTR_MAX)
    size = _in_range(size, "free: size", _SIZE_MAX)
    stream = _in_range(stream, "free: stream", _PTR_MAX)
    d = _device(device)
    if ptr and library().cucache_torch_free_checked(
            ctypes.c_void_p(ptr), size, d, ctypes.c_void_p(stream or None)) != 0:
        raise RuntimeError(_error("free"))


def _release(ptr: int, size: int, device: int, stream: int) -> None:
    """free() for the finalizers of the CuPy and Numba front ends, which must not raise (Numba
    runs them inside its own calls): a refused free is printed to stderr and counted in
    bad_free_count(), as torch's allocator hook does."""
    if ptr:
        library().cucache_torch_free(ctypes.c_void_p(ptr), size, device, ctypes.c_void_p(stream or None))


def snapshot() -> dict[str, Any]:
    """Every device's segments and blocks, and (CUCACHE_CONF history:N) its last N events, in the
    structure of torch.cuda.memory._snapshot(): {"segments": [...], "device_traces": [[...]]}
    (docs/python.md). dump_snapshot() writes it as the pickle PyTorch's memory viewer reads."""
    _configured()
    with tempfile.TemporaryDirectory(prefix="cucache-snapshot-") as folder:
        path = os.path.join(folder, "snapshot.json")
        _check(library().cucache_torch_write_snapshot(path.encode()), "snapshot")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    return _as_torch(data)


def _as_torch(data: dict[str, Any]) -> dict[str, Any]:
    # JSON has no tuples: PyTorch's segment_pool_id is a pair.
    for seg in data.get("segments", []):
        seg["segment_pool_id"] = tuple(seg["segment_pool_id"])
    return data


def dump_snapshot(path: "os.PathLike[str] | str", snapshot_data: Optional[dict[str, Any]] = None) -> None:
    """Writes snapshot() (or `snapshot_data`) to `path`: a pickle, which torch.cuda._memory_viz and
    pytorch.org/memory_viz open, or JSON when the name ends in ".json". Written under a temporary
    name in the same folder and renamed, so nothing partial is ever left at `path`; an unwritable
    path raises OSError naming it."""
    data = snapshot() if snapshot_data is None else snapshot_data
    target = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(target))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=".cucache-snapshot-", dir=folder)
        with os.fdopen(fd, "wb") as f:
            if target.endswith(".json"):
                f.write(json.dumps(_as_json(data)).encode())
            else:
                pickle.dump(data, f)
        os.replace(tmp, target)
        tmp = None
    except OSError as e:
        raise OSError(e.errno, f"cucache: dump_snapshot: cannot write {target!r}: {e.strerror}") from e
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def _as_json(data: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(data))  # tuples become lists


def load_snapshot(path: "os.PathLike[str] | str") -> dict[str, Any]:
    """Reads a file dump_snapshot wrote (pickle, or JSON by its ".json" name)."""
    target = os.fspath(path)
    if target.endswith(".json"):
        with open(target, encoding="utf-8") as f:
            return _as_torch(json.load(f))
    with open(target, "rb") as f:
        return pickle.load(f)


def mark_step() -> None:
    """Ends a step of the program's loop, for leak hunting (CUCACHE_CONF leak_steps:K)."""
    _configured()
    _check(library().cucache_torch_mark_step(), "mark_step")


def leak_report(steps: int = 0) -> dict[str, Any]:
    """{"step": S, "steps": K, "candidates": [{device, address, size, stream, tag, step,
    steps_alive, frames}]}: allocations alive for more than K steps (K = steps, or leak_steps)
    while their device's live total grew, largest first."""
    _configured()
    return json.loads(_text(lambda _d, b, n: library().cucache_torch_leak_report(steps, b, n), 0,
                            "leak_report"))


def push_tag(name: str) -> None:
    """Makes `name` the calling thread's current tag (tags nest); see tag()."""
    encoded = _tag_name(name)
    _configured()
    _check(library().cucache_torch_push_tag(encoded), "push_tag")


def pop_tag() -> None:
    """Ends the calling thread's current tag; RuntimeError when it has none."""
    _check(library().cucache_torch_pop_tag(), "pop_tag")


def _tag_name(name: str) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"cucache: a tag is a str, not {type(name).__name__}")
    if "\0" in name:
        raise ValueError(f"cucache: tag {name!r} contains a NUL character")
    return name.encode()


# The tag tag_backward() pushed on each thread that ran a hook of it (thread ident -> name).
_backward_tags: dict[int, str] = {}
_backward_lock = threading.Lock()


def tag_backward(tensor: Any, name: str, sleepable: bool = False) -> None:
    """Tags the backward pass of `tensor` (a torch tensor that requires grad: the loss) with `name`.

    Tags belong to threads, and torch runs the backward pass of CUDA tensors on its own worker
    thread, so `with tag(name): loss.backward()` leaves the gradients and backward temporaries
    untagged (and, for a sleepable tag, outside its pages: sleep(name) does not give them back).
    This registers a hook on `tensor`, which torch runs on the thread that runs its backward,
    before the first backward node; on a thread other than the caller's it makes `name` that
    thread's tag, once (the worker runs only backward work, so the tag stays until a later
    tag_backward names another one there). On the caller's own thread (a CPU backward) it does
    nothing: the caller's tags apply there. sleepable=True makes the tag sleepable first."""
    _tag_name(name)
    if not hasattr(tensor, "register_hook"):
        raise TypeError(f"cucache: tag_backward needs a tensor with register_hook, not "
                        f"{type(tensor).__name__}")
    if sleepable:
        make_sleepable(name)
    caller = threading.get_ident()

    def hook(grad: Any) -> Any:
        me = threading.get_ident()
        if me == caller:
            return grad
        with _backward_lock:
            current = _backward_tags.get(me)
            if current != name:
                if current is not None:
                    pop_tag()
                push_tag(name)
                _backward_tags[me] = name
        return grad

    tensor.register_hook(hook)


@contextlib.contextmanager
def tag(name: str, sleepable: bool = False) -> Iterator[None]:
    """with cucache.tag("kv_cache"): allocations made on this thread inside the block count for
    the tag in tag_stats(), memory_summary(), snapshots and leak reports. sleepable=True makes the
    tag sleepable first (make_sleepable): its allocations get pages of their own, so that
    sleep(name) can give their memory back."""
    if sleepable:
        make_sleepable(name)
    push_tag(name)
    try:
        yield
    finally:
        pop_tag()


def make_sleepable(name: str) -> None:
    """Makes tag `name` sleepable, process-wide and for good (expandable segments): allocations
    made under it from now on are placed in physical pages no other tag's or untagged allocation
    shares. Call it before allocating under the tag (or use tag(name, sleepable=True))."""
    b = _tag_name(name)
    _configured()
    _check(library().cucache_torch_make_sleepable(b), "make_sleepable")


def sleep(name: Any, keep_contents: Any = True, device: Any = None) -> None:
    """Gives back the device memory of every live allocation of sleepable tag `name` (and its
    cached pages), keeping their addresses: tensors keep their data_ptr(), but must not be used,
    freed or allocated under the tag until wake(name). keep_contents=True copies their bytes to
    pinned host memory first (wake restores them); False drops them (a KV cache). Waits for the
    device's queued work. RuntimeError with cucache's message on any misuse (unknown or not
    sleepable tag, asleep already, expandable segments off, a live allocation exported by IPC),
    with nothing changed; TypeError when keep_contents is not a bool.

    Several tags in one call: `name` a list of tags, keep_contents one bool for all of them or a
    list of bools, one per tag (sleep(["weights", "kv_cache"], [True, False])). Every tag is
    checked first and any refusal changes nothing for any tag; a device failure part way leaves
    the tags before the failing one asleep and those after it awake, and says so (docs/api.md,
    "Sleep and wake")."""
    if isinstance(name, (list, tuple)):
        names = [_tag_name(n) for n in name]
        if isinstance(keep_contents, bool):
            keeps = [keep_contents] * len(names)
        elif isinstance(keep_contents, (list, tuple)):
            keeps = list(keep_contents)
            if len(keeps) != len(names):
                raise ValueError(
                    f"cucache: sleep: {len(names)} tags but {len(keeps)} keep_contents values"
                )
        else:
            raise TypeError(
                "cucache: sleep: keep_contents must be True, False or a list of them, "
                f"not {keep_contents!r}"
            )
        for k in keeps:
            if not isinstance(k, bool):
                raise TypeError(f"cucache: sleep: keep_contents must be True or False, not {k!r}")
        d = _ready(_device(device))
        tags = (ctypes.c_char_p * len(names))(*names)
        flags = (ctypes.c_int * len(names))(*[1 if k else 0 for k in keeps])
        _check(library().cucache_torch_sleep_tags(d, tags, flags, len(names)), "sleep")
        return
    b = _tag_name(name)
    if not isinstance(keep_contents, bool):
        # bool('no') is True: anything but a bool is refused rather than guessed at.
        raise TypeError(
            f"cucache: sleep: keep_contents must be True or False, not {keep_contents!r}"
        )
    d = _ready(_device(device))
    _check(library().cucache_torch_sleep(d, b, 1 if keep_contents else 0), "sleep")


def prepare_sleep(name: str, nbytes: int = 0, device: Any = None) -> int:
    """Pins, ahead of the next sleep(name, keep_contents=True), the host buffer that sleep copies
    into: at least `nbytes` and at least the tag's allocated bytes now. Without it the first kept
    sleep pins the buffer itself (seconds for gigabytes: cudaHostAlloc). Call it once after
    loading the weights; it releases the GIL and holds no allocator lock while pinning, so it can
    run on a thread of its own. Returns the buffer's bytes; nothing is pinned when the tag's
    buffer is large enough already. A sleep with keep_contents=False frees the buffer.
    RuntimeError (unknown or not sleepable tag, asleep, expandable segments off, the host cannot
    pin that much) with nothing changed."""
    b = _tag_name(name)
    nbytes = _in_range(nbytes, "prepare_sleep: nbytes", _SIZE_MAX)
    d = _ready(_device(device))
    out = ctypes.c_uint64(0)
    _check(library().cucache_torch_prepare_sleep(d, b, nbytes, ctypes.byref(out)), "prepare_sleep")
    return int(out.value)


def wake(name: Any, device: Any = None) -> float:
    """Maps new device memory under the sleeping tag's allocations at the same addresses and
    restores their contents (when sleep kept them); returns the seconds the host-to-device copies
    took (0.0 when nothing was kept). RuntimeError when the tag is not asleep, or when the device
    has no room -- the tag then stays asleep and the message says how much was missing.
    `name` a list of tags: all of them in one call, all or none (each must be asleep; the room
    needed is that of all of them)."""
    d_arg = device
    if isinstance(name, (list, tuple)):
        names = [_tag_name(n) for n in name]
        d = _ready(_device(d_arg))
        tags = (ctypes.c_char_p * len(names))(*names)
        secs = ctypes.c_double(0.0)
        _check(library().cucache_torch_wake_tags(d, tags, len(names), ctypes.byref(secs)), "wake")
        return float(secs.value)
    b = _tag_name(name)
    d = _ready(_device(d_arg))
    secs = ctypes.c_double(0.0)
    _check(library().cucache_torch_wake(d, b, ctypes.byref(secs)), "wake")
    return float(secs.value)


def sleeping(device: Any = None) -> dict[str, dict[str, int]]:
    """The sleeping tags of one device: {"train": {"bytes": device bytes given back,
    "host_bytes": pinned host bytes holding their contents, "copy_seconds": what sleep's
    device-to-host copies took}}."""
    d = _ready(_device(device))
    rows = json.loads(_text(library().cucache_torch_sleeping, d, "sleeping"))
    return {r.pop("tag"): r for r in rows}


def tag_stats(device: Any = None) -> dict[str, dict[str, Any]]:
    """Per tag on one device: {"kv_cache": {"current_bytes", "peak_bytes", "allocations",
    "total_allocations", "limit_bytes", "limit_refusals"}} (requested bytes of live allocations;
    limit_bytes is None for a tag without a limit). Lists the tags that allocated on the device
    or have a limit there."""
    d = _ready(_device(device))
    rows = json.loads(_text(library().cucache_torch_tag_stats, d, "tag_stats"))
    return {r.pop("tag"): r for r in rows}


_NO_TAG_LIMIT = 2**64 - 1  # cucache_torch.h: UINT64_MAX is no limit


def set_tag_limit(name: str, nbytes: Optional[int], device: Any = None) -> None:
    """Limits the bytes tag `name` may hold on one device (docs/python.md, "Tag limits"): an
    allocation under the tag that would take its use (requested bytes of its live allocations, as
    tag_stats counts them) past `nbytes` fails as out of memory -- MemoryError from alloc(),
    torch.OutOfMemoryError through PyTorch -- with a message naming the tag, its limit, its use
    and the request, and nothing else changes. None removes the limit; 0 allows nothing. A limit
    below the tag's use is kept: its allocations fail until frees bring it under."""
    b = _tag_name(name)
    if not name:
        raise ValueError("cucache: set_tag_limit: the tag is empty")
    limit = _NO_TAG_LIMIT if nbytes is None else _in_range(nbytes, "set_tag_limit: nbytes", _SIZE_MAX)
    d = _ready(_device(device))
    _check(library().cucache_torch_set_tag_limit(d, b, limit), "set_tag_limit")


def tag_limit(name: str, device: Any = None) -> Optional[int]:
    """The limit of tag `name` on one device in bytes, None when it has none."""
    b = _tag_name(name)
    if not name:
        raise ValueError("cucache: tag_limit: the tag is empty")
    d = _ready(_device(device))
    out = ctypes.c_uint64(0)
    _check(library().cucache_torch_tag_limit(d, b, ctypes.byref(out)), "tag_limit")
    return None if out.value in (_NO_TAG_LIMIT, _SIZE_MAX) else int(out.value)


def metrics_text() -> str:
    """Every statistics field of every device used so far, per device, pool and tag, in
    Prometheus' text exposition format (docs/python.md, "Metrics"); cucache.metrics wraps it."""
    _configured()
    return _text(lambda _d, b, n: library().cucache_torch_metrics(b, n), 0, "metrics")


def memory_stats(device: Any = None) -> dict[str, Any]:
    """cucache's statistics of one device, under torch.cuda.memory_stats()'s key names
    ("allocated_bytes.all.current", "reserved_bytes.large_pool.peak", ...) plus cucache's own
    ("fragmentation.external", "fragmentation.overhead", "largest_free_block", ...)."""
    s = _Stats()
    _check(library().cucache_torch_get_stats(_ready(_device(device)), ctypes.byref(s)), "get_stats")
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
    # The text can grow between the size query and the copy (other threads allocate): each retry
    # takes the size the last call reported, with room to spare, so it fits unless the text grows
    # by more than a quarter between two consecutive calls sixteen times in a row.
    n = fn(device, None, 0)
    for _ in range(16):
        if n < 0:
            _check(-1, what)
        buf = ctypes.create_string_buffer(int(n) + int(n) // 4 + 4096)
        n = fn(device, buf, len(buf))
        if 0 <= n < len(buf):
            return buf.value.decode(errors="replace")
    raise RuntimeError(f"cucache: {what}: the text kept growing faster than it could be copied")


def memory_summary(device: Any = None) -> str:
    """PyTorch-style table of the statistics of one device."""
    return _text(library().cucache_torch_memory_summary, _ready(_device(device)), "memory_summary")


def snapshot_json(device: Any = None) -> str:
    """Every segment and block of one device, as JSON."""
    return _text(library().cucache_torch_snapshot_json, _ready(_device(device)), "snapshot_json")


def empty_cache() -> None:
    """Returns every wholly free cached segment of every device to the driver."""
    _configured()
    _check(library().cucache_torch_empty_cache(), "empty_cache")


def max_allocatable(device: Any = None) -> int:
    """The largest single allocation on one device that would succeed now, in bytes: a cached
    free block, or new memory once the out-of-memory path gave back what it may, under the
    device's free memory and the memory limit (exact on the simulated device)."""
    out = ctypes.c_size_t(0)
    _check(library().cucache_torch_max_allocatable(_ready(_device(device)), ctypes.byref(out)), "max_allocatable")
    return int(out.value)


def reserve(nbytes: int, device: Any = None) -> None:
    """Caches nbytes of free memory on one device now, so that the first allocations make no
    device call (CUCACHE_CONF reserve_mb:N does it when the allocator is created)."""
    nbytes = _in_range(nbytes, "reserve: nbytes", _SIZE_MAX)
    _check(library().cucache_torch_reserve(_ready(_device(device)), nbytes), "reserve")


def reset_peak_memory_stats(device: Any = None) -> None:
    """Resets the peaks of one device (the current one for None). RuntimeError for a device that
    does not exist, -1 included, as torch.cuda.reset_peak_memory_stats raises."""
    _check(library().cucache_torch_reset_peak_stats(_ready(_device(device))), "reset_peak_stats")


def bad_free_count() -> int:
    """Frees of pointers cucache did not own, or had freed already, seen so far."""
    return int(library().cucache_torch_bad_free_count())
