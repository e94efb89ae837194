"""umm as PyTorch's CUDA allocator, in one call.

    import umm_torch
    umm_torch.enable()                  # before anything allocates CUDA memory
    ...train...
    print(umm_torch.memory_summary())   # umm's statistics as torch.cuda.memory_summary() shows them

    with umm_torch.pool():              # or: only a block of code, in a program that already uses CUDA
        ...

enable() loads libumm_capi.so (shipped in this package's wheel; in a checkout, built with `cargo build --release
-p umm-capi`) and makes umm a CUDA allocator of PyTorch's own (allocator.cpp, compiled on first use): CUDA graphs
allocate from private pools, and torch.cuda's own statistics, snapshots, empty_cache() and CUDA IPC work on umm.
The functions of this module of the same names stay as aliases; they fall back to torch.cuda's when umm is not
enabled, so code can call them either way. pool() serves a block of code through a CUDAPluggableAllocator.

Without a GPU, UMM_CAPI_SIM=16GiB (or 2x16GiB) gives the library simulated devices: addresses and statistics as on
a GPU, no bytes behind them. Tests of programs that drive the library use it.
"""

import contextlib
import ctypes
import json
import os
import threading
import warnings

_LIB_NAME = "libumm_capi.so"
_lib = None
_lib_path = None


def _candidates():
    env = os.environ.get("UMM_CAPI_LIB")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))  # umm_torch/ -> torch/ -> bindings/ -> root
    yield os.path.join(here, _LIB_NAME)  # the wheel's copy
    for target in (os.environ.get("CARGO_TARGET_DIR"), os.path.join(root, "target")):
        if target:
            yield os.path.join(target, "release", _LIB_NAME)
    yield os.path.join(root, ".device", "capi", _LIB_NAME)


def find_library():
    """Path of libumm_capi.so: $UMM_CAPI_LIB, the one in this package (a wheel), or the workspace's
    target/release (a checkout)."""
    for path in _candidates():
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"{_LIB_NAME} not found; build it with `cargo build --release -p umm-capi` or set UMM_CAPI_LIB"
    )


def load(path=None):
    """Loads the library with ctypes (no PyTorch needed) and declares its functions. Returns the CDLL."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    path = path or find_library()
    lib = ctypes.CDLL(path)
    lib.umm_alloc.restype = ctypes.c_void_p
    lib.umm_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.umm_free.restype = None
    lib.umm_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.umm_last_error.restype = ctypes.c_char_p
    lib.umm_last_error.argtypes = []
    lib.umm_clear_error.restype = None
    lib.umm_device_count.restype = ctypes.c_int
    lib.umm_stats_json.restype = ctypes.c_void_p  # freed with umm_string_free, so not c_char_p
    lib.umm_stats_json.argtypes = [ctypes.c_int]
    lib.umm_string_free.restype = None
    lib.umm_string_free.argtypes = [ctypes.c_void_p]
    lib.umm_empty_cache.restype = ctypes.c_int64
    lib.umm_empty_cache.argtypes = [ctypes.c_int]
    lib.umm_set_limit.restype = ctypes.c_int
    lib.umm_set_limit.argtypes = [ctypes.c_int, ctypes.c_uint64]
    lib.umm_reset_peaks.restype = ctypes.c_int
    lib.umm_reset_peaks.argtypes = [ctypes.c_int]
    lib.umm_mark_step.restype = ctypes.c_int
    lib.umm_mark_step.argtypes = [ctypes.c_int]
    lib.umm_snapshot_json.restype = ctypes.c_void_p
    lib.umm_snapshot_json.argtypes = [ctypes.c_int]
    lib.umm_record_history.restype = ctypes.c_int
    lib.umm_record_history.argtypes = [ctypes.c_int64]
    lib.umm_trace_flush.restype = ctypes.c_int
    lib.umm_trace_flush.argtypes = []
    lib.umm_set_tag.restype = ctypes.c_int
    lib.umm_set_tag.argtypes = [ctypes.c_char_p]
    lib.umm_sleep.restype = ctypes.c_void_p
    lib.umm_sleep.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
    lib.umm_wake.restype = ctypes.c_void_p
    lib.umm_wake.argtypes = [ctypes.c_char_p]
    lib.umm_sleeping_json.restype = ctypes.c_void_p
    lib.umm_sleeping_json.argtypes = []
    _lib, _lib_path = lib, path
    return lib


def _import_torch(what):
    """torch, or a ModuleNotFoundError that says which call needs it and what works without it."""
    try:
        import torch
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            f"umm_torch.{what}() needs PyTorch, which is not installed (pip install torch). Without it, the "
            "library's own calls work (umm_stats(), sleep(), wake(), set_limit()), and UMM_CAPI_SIM=16GiB gives "
            "simulated devices whose memory_stats() and memory_summary() need no PyTorch",
            name="torch",
        ) from e
    return torch


def enable(path=None):
    """Makes umm PyTorch's CUDA allocator. Call before the first CUDA allocation of the process (PyTorch
    refuses to swap an allocator that has been used). Returns the library path.

    umm becomes a CUDA allocator of PyTorch's own through a C++ adapter (allocator.cpp) compiled against the
    installed PyTorch and the CUDA toolkit's headers on first use and cached (~/.cache/umm_torch; UMM_TORCH_ADAPTER=off
    skips it). Then CUDA graphs allocate from private pools that serve nothing else while the graph lives,
    torch.cuda.memory_stats(), memory_summary(), memory._snapshot(), empty_cache() and
    set_per_process_memory_fraction() read and act on umm, tensors in plain segments cross processes through CUDA
    IPC (UMM_SEGMENT_MODE=plain for all of them), and an allocation umm cannot serve raises torch.OutOfMemoryError
    with umm's figures. Without the adapter (no C++ compiler or CUDA headers) enable() warns and falls back to a
    CUDAPluggableAllocator, which has none of these."""
    torch = _import_torch("enable")

    global _enabled
    load(path)
    from . import _adapter

    adapter = _adapter.build(_lib_path)
    if adapter is not None:
        library = ctypes.CDLL(adapter)
        library.umm_torch_install_error.restype = ctypes.c_char_p
        if library.umm_torch_install() != 0:
            raise RuntimeError(f"umm_torch.enable(): {library.umm_torch_install_error().decode()}")
        _enabled = True
        return _lib_path
    allocator = _pluggable_allocator(path)
    torch.cuda.memory.change_current_allocator(allocator)
    _enabled = True
    return _lib_path


_enabled = False
_allocator = None
_allocator_lock = threading.Lock()


def _pluggable_allocator(path=None):
    """One CUDAPluggableAllocator over umm for the process (enable() and pool() share it)."""
    global _allocator
    torch = _import_torch("pool")

    with _allocator_lock:
        if _allocator is None:
            load(path)
            from . import _adapter

            adapter = _adapter.build(_lib_path)
            if adapter is None:
                _allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "umm_alloc", "umm_free")
            else:
                _allocator = torch.cuda.memory.CUDAPluggableAllocator(adapter, "umm_torch_alloc", "umm_free")
        return _allocator


_pools = {}
_inside = threading.local()


@contextlib.contextmanager
def pool(device=None):
    """Serves the CUDA allocations of a block of code from umm, in a program that already uses PyTorch's
    allocator: `with umm_torch.pool(): ...`. Works through torch.cuda.MemPool and torch.cuda.use_mem_pool (PyTorch
    2.5 and later): PyTorch keeps its caching on top, and asks umm for its segments. use_mem_pool routes the
    allocations of the thread that entered it (not those of autograd's backward threads), and PyTorch lets one
    thread at a time route to a MemPool, so each thread gets a MemPool of its own per device, reused by its later
    blocks; a pool() inside a pool() of the same thread and device changes nothing. An out-of-memory inside raises
    torch.OutOfMemoryError with umm's figures appended. Yields the MemPool."""
    with _routed(device, None) as mem_pool:
        yield mem_pool


@contextlib.contextmanager
def _routed(device, tag_name):
    """Routes the thread's allocations on `device` to umm through the MemPool of (device, thread, tag)."""
    torch = _import_torch("pool")

    index = _device_index(device)
    active = getattr(_inside, "devices", None)
    if active is None:
        active = _inside.devices = {}
    if (index, tag_name) in active:  # nested: the outer block already routes this thread
        yield active[(index, tag_name)]
        return
    key = (index, threading.get_ident()) if tag_name is None else (index, threading.get_ident(), tag_name)
    with _allocator_lock:
        mem_pool = _pools.get(key)
    if mem_pool is None:
        allocator = _pluggable_allocator()
        mem_pool = torch.cuda.MemPool(allocator.allocator())
        with _allocator_lock:
            mem_pool = _pools.setdefault(key, mem_pool)
    active[(index, tag_name)] = mem_pool
    try:
        with torch.cuda.use_mem_pool(mem_pool, device=index):
            yield mem_pool
    except torch.OutOfMemoryError as oom:
        detail = last_error()
        if detail and ("out of memory" in detail or "asleep" in detail):
            raise torch.OutOfMemoryError(f"{oom}\n{detail}") from oom
        raise
    finally:
        del active[(index, tag_name)]


_tags = threading.local()


def _set_tag(name):
    if load().umm_set_tag(None if name is None else name.encode()) != 0:
        raise ValueError(last_error())


def current_tag():
    """The calling thread's tag (see tag()), or None."""
    return getattr(_tags, "name", None)


def _routes_through_mem_pools():
    """Whether tag() needs a MemPool: PyTorch uses CUDA and umm is not its whole allocator."""
    if enabled():
        return False
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


@contextlib.contextmanager
def tag(name, device=None):
    """Tags the CUDA memory the calling thread allocates inside the block ("weights", "kv_cache"), so that
    sleep() can offload or discard it and wake() bring it back at the same addresses:

        with umm_torch.tag("weights"):
            model = load_model().cuda()
        with umm_torch.tag("kv_cache"):
            cache = torch.empty(...)

    Under enable() the tag alone routes the allocations. Otherwise the block's allocations go to umm through a
    MemPool of their own per (device, thread, tag), like pool(), so that PyTorch's cache never hands a tag's
    memory to another tag; tensors made outside (CUDA graphs' private pools, activations) stay with PyTorch's
    allocator and stay awake. Use tag() outside pool() blocks. Tags nest; a tag has 1 to 128 bytes, no commas.
    Yields the MemPool (None under enable() or without a GPU)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tag {name!r}: a tag is a string of 1 to 128 bytes, without control characters or commas")
    previous = current_tag()
    _set_tag(name)
    _tags.name = name
    try:
        if _routes_through_mem_pools():
            with _routed(device, name) as mem_pool:
                yield mem_pool
        else:
            yield None
    finally:
        _tags.name = previous
        _set_tag(previous)


def _tag_list(tags):
    if tags is None:
        return []
    if isinstance(tags, str):
        return [tags]
    return list(tags)


def _json_call(p, what):
    lib = load()
    if not p:
        raise RuntimeError(last_error() or f"{what} failed")
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib.umm_string_free(p)


def sleep(offload=(), discard=()):
    """Puts tagged memory to sleep on every device: the `offload` tags' bytes are copied to pinned host memory,
    the `discard` tags' dropped, and their device pages given back, every tensor keeping its address. Queued
    CUDA work is waited for first. Until wake(), the tags refuse allocations (torch.OutOfMemoryError naming the
    sleeping tag) and their tensors must not be used. Tensors of tags not named stay awake. All or nothing: a
    tag that cannot sleep (UMM_SEGMENT_MODE=plain) leaves everything awake and raises. Returns umm's report (a
    dict: pools, bytes_released, bytes_offloaded, seconds)."""
    offload, discard = _tag_list(offload), _tag_list(discard)
    lib = load()
    return _json_call(lib.umm_sleep(",".join(offload).encode(), ",".join(discard).encode()), "umm_sleep")


def wake(tags=None):
    """Wakes `tags` (every sleeping tag by default): device pages are mapped again at the tensors' addresses
    and offloaded bytes copied back, so kernels' pointers and captured CUDA graphs work again; discarded tensors
    hold undefined values. Returns umm's report (a dict: pools, bytes_mapped, bytes_restored, seconds)."""
    tags = _tag_list(tags)
    return _json_call(load().umm_wake(",".join(tags).encode() if tags else None), "umm_wake")


def sleeping():
    """The sleeping tags: a dict tag -> "offload" or "discard"."""
    return _json_call(load().umm_sleeping_json(), "umm_sleeping_json")


def pools():
    """The MemPools pool() made, by (device index, thread identifier), and those tag() made, by (device index,
    thread identifier, tag)."""
    return dict(_pools)


def enabled():
    """Whether enable() made umm the allocator of this process."""
    return _enabled and _allocator_is_pluggable()


def _allocator_is_pluggable():
    try:
        import torch

        return torch.cuda.memory.get_allocator_backend() not in ("native", "cudaMallocAsync")
    except Exception:
        return True


def last_error():
    """The calling thread's last umm error message, or None."""
    msg = load().umm_last_error()
    return msg.decode() if msg else None


def _device_index(device):
    if device is None:
        try:
            import torch

            return torch.cuda.current_device() if torch.cuda.is_available() else 0
        except ImportError:  # the library alone (simulated devices, C ABI tests)
            return 0
    if isinstance(device, int):
        return device
    index = getattr(device, "index", None)  # torch.device
    return 0 if index is None else index


def umm_stats(device=None):
    """umm's own statistics of one device, as umm_stats_json returns them (a dict)."""
    lib = load()
    p = lib.umm_stats_json(_device_index(device))
    if not p:
        raise RuntimeError(last_error() or "umm_stats_json failed")
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib.umm_string_free(p)


# torch.cuda.memory_stats() keys umm fills, from its own statistics: (torch key, umm key, part).
_FILLED = [
    (f"{key}.all.{part}", key, part)
    for key in ("allocated_bytes", "requested_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes")
    for part in ("current", "peak")
] + [
    ("allocation.all.current", "active_blocks", "current"),
    ("allocation.all.peak", "active_blocks", "peak"),
    ("allocation.all.allocated", "num_allocs", None),
    ("allocation.all.freed", "num_frees", None),
    ("active.all.current", "active_blocks", "current"),
    ("active.all.peak", "active_blocks", "peak"),
    ("active.all.allocated", "num_allocs", None),
    ("active.all.freed", "num_frees", None),
    ("segment.all.current", "segments", "current"),
    ("segment.all.peak", "segments", "peak"),
    ("segment.all.allocated", "num_device_alloc", None),
    ("segment.all.freed", "num_device_free", None),
    ("num_alloc_retries", "num_alloc_retries", None),
    ("num_ooms", "num_ooms", None),
    ("num_device_alloc", "num_device_alloc", None),
    ("num_device_free", "num_device_free", None),
]


def _absent_keys():
    keys = []
    for stat in ("allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes",
                 "active_bytes", "inactive_split_bytes", "requested_bytes", "oversize_allocations",
                 "oversize_segments"):
        pools = ("all", "large_pool", "small_pool") if not stat.startswith("oversize") else (None,)
        for pool_name in pools:
            for part in ("current", "peak", "allocated", "freed"):
                key = f"{stat}.{pool_name}.{part}" if pool_name else f"{stat}.{part}"
                keys.append(key)
    keys += ["num_sync_all_streams", "max_split_size"]
    filled = {k for k, _, _ in _FILLED}
    return sorted(k for k in keys if k not in filled)


ABSENT_KEYS = tuple(_absent_keys())
"""Keys of torch.cuda.memory_stats() that umm does not fill: the large/small pool split (umm's pools split by
size class differently), cumulative byte totals, inactive-split counts, oversize counts, num_sync_all_streams
and max_split_size (umm has no such setting)."""


def memory_stats(device=None):
    """umm's statistics under the key names of torch.cuda.memory_stats() ("reserved_bytes.all.peak", ...),
    sorted as PyTorch sorts them, or torch.cuda.memory_stats() itself when umm is not the allocator. Keys umm
    cannot fill are left out (listed in ABSENT_KEYS); umm's own figures follow under "umm." keys."""
    if not enabled() and not _simulated():
        torch = _import_torch("memory_stats")

        return torch.cuda.memory_stats(device)
    return _memory_stats_from(umm_stats(device))


def _memory_stats_from(s):
    out = {}
    for key, umm_key, part in _FILLED:
        out[key] = s[umm_key][part] if part else s[umm_key]
    for key in ("cache_hits", "cache_misses", "hit_rate", "limit_bytes", "virtual_memory", "num_steps_planned",
                "num_stitches", "fragmentation_ratio", "pending_frees", "live_pointers"):
        if key in s:
            out[f"umm.{key}"] = s[key]
    return dict(sorted(out.items()))


def _simulated():
    """Whether the library runs on simulated devices (UMM_CAPI_SIM): its figures stand without PyTorch."""
    return bool(os.environ.get("UMM_CAPI_SIM"))


def memory_summary(device=None, abbreviated=False):
    """A table of umm's memory in the layout of torch.cuda.memory_summary(): current and peak usage, totals
    allocated and freed where umm counts them ("n/a" where it does not)."""
    if not enabled() and not _simulated():
        torch = _import_torch("memory_summary")

        return torch.cuda.memory_summary(device, abbreviated)
    s = umm_stats(device)
    return _summary_from(s, _device_index(device))


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024.0


def _summary_from(s, device):
    width = 79
    rule = "|" + "=" * (width - 2) + "|"
    line = "|" + "-" * (width - 2) + "|"

    def row(name, cur, peak, alloc="n/a", freed="n/a"):
        return f"| {name:<24}| {cur:>10} | {peak:>10} | {alloc:>10} | {freed:>10} |"

    out = [rule, f"| {'umm memory summary, device ID ' + str(device):<{width - 4}} |", line,
           f"| {s.get('device_name', ''):<{width - 4}} |", rule,
           row("Metric", "Cur Usage", "Peak Usage", "Tot Alloc", "Tot Freed"), line]
    for name, key in (("Allocated memory", "allocated_bytes"), ("Active memory", "active_bytes"),
                      ("Requested memory", "requested_bytes"), ("GPU reserved memory", "reserved_bytes"),
                      ("Non-releasable memory", "inactive_split_bytes")):
        out.append(row(name, _fmt_bytes(s[key]["current"]), _fmt_bytes(s[key]["peak"])))
    out.append(line)
    out.append(row("Allocations", s["active_blocks"]["current"], s["active_blocks"]["peak"], s["num_allocs"],
                   s["num_frees"]))
    out.append(row("GPU reserved segments", s["segments"]["current"], s["segments"]["peak"], s["num_device_alloc"],
                   s["num_device_free"]))
    out.append(line)
    limit = s.get("limit_bytes")
    out.append(f"| {'Cache hits / misses':<24}| {s['cache_hits']:>10} | {s['cache_misses']:>10} |{'':>25}|")
    out.append(f"| {'OOMs / alloc retries':<24}| {s['num_ooms']:>10} | {s['num_alloc_retries']:>10} |{'':>25}|")
    out.append(f"| {'Limit':<24}| {(_fmt_bytes(limit) if limit else 'none'):>10} |{'':>38}|")
    if s.get("asleep_bytes"):
        out.append(f"| {'Asleep / offloaded':<24}| {_fmt_bytes(s['asleep_bytes']):>10} | "
                   f"{_fmt_bytes(s['offloaded_bytes']):>10} |{'':>25}|")
    out.append(rule)
    return "\n".join(out) + "\n"


def record_memory_history(enabled="all", max_entries=100000):
    """Starts (or, with enabled=None, stops) recording umm's allocation events for snapshot()'s device_traces,
    as torch.cuda.memory._record_memory_history does. A new start drops the events recorded before; a stop
    keeps them."""
    entries = 0 if enabled is None else int(max_entries)
    if load().umm_record_history(entries) != 0:
        raise RuntimeError(last_error())


def snapshot(device=None):
    """umm's memory in the shape of torch.cuda.memory._snapshot(): a dict with "segments" (each with its
    "blocks") and "device_traces" (see record_memory_history), which torch.cuda._memory_viz and
    pytorch.org/memory_viz draw. device=None: every device, as PyTorch's snapshot has them."""
    lib = load()
    p = lib.umm_snapshot_json(-1 if device is None else _device_index(device))
    if not p:
        raise RuntimeError(last_error() or "umm_snapshot_json failed")
    try:
        return json.loads(ctypes.string_at(p).decode())
    finally:
        lib.umm_string_free(p)


def dump_snapshot(filename="dump_snapshot.pickle", device=None):
    """Writes snapshot() as a pickle, as torch.cuda.memory._dump_snapshot does, for pytorch.org/memory_viz."""
    import pickle

    with open(filename, "wb") as f:
        pickle.dump(snapshot(device), f)


def _stat(key, part, torch_fn, device):
    if not enabled() and not _simulated():
        torch = _import_torch(torch_fn)

        return getattr(torch.cuda, torch_fn)(device)
    return umm_stats(device)[key][part]


def memory_allocated(device=None):
    return _stat("allocated_bytes", "current", "memory_allocated", device)


def max_memory_allocated(device=None):
    return _stat("allocated_bytes", "peak", "max_memory_allocated", device)


def memory_reserved(device=None):
    return _stat("reserved_bytes", "current", "memory_reserved", device)


def max_memory_reserved(device=None):
    return _stat("reserved_bytes", "peak", "max_memory_reserved", device)


def reset_peak_memory_stats(device=None):
    if not enabled() and not _simulated():
        torch = _import_torch("reset_peak_memory_stats")

        return torch.cuda.reset_peak_memory_stats(device)
    if load().umm_reset_peaks(-1 if device is None else _device_index(device)) != 0:
        raise RuntimeError(last_error())


def step(device=None):
    """Marks the end of a training or inference step (call it at the same point of every step, e.g. after
    optimizer.step()). Once two steps in a row allocate alike, umm serves the tensors that live within a step from
    one planned segment of the step's peak size. Does nothing under PyTorch's own allocator."""
    if not enabled():
        return
    if load().umm_mark_step(-1 if device is None else _device_index(device)) != 0:
        raise RuntimeError(last_error())


def empty_cache(device=None):
    """Gives umm's cached memory back to the driver (torch.cuda.empty_cache() does nothing under a pluggable
    allocator). Where pool() was used, PyTorch's cache is emptied first, so that the segments it gives back
    (those of its default pool, and of MemPools no block is using) reach umm's cache before umm's goes back; a
    MemPool in use keeps its cached segments. Returns the bytes umm released (None under PyTorch's allocator
    alone)."""
    in_pool = bool(_pools)
    if in_pool or (not enabled() and not _simulated()):
        torch = _import_torch("empty_cache")

        torch.cuda.empty_cache()  # PyTorch's cache, and the segments of pool()'s MemPools that it releases
        if not in_pool:
            return None
    released = load().umm_empty_cache(-1 if device is None else _device_index(device))
    if released < 0:
        raise RuntimeError(last_error())
    return released


def set_limit(nbytes, device=None):
    """Caps the bytes umm reserves in each device's main pool (0 removes the cap); past it, allocations fail like an
    out-of-memory. Tagged pools (tag()) and CUDA graphs' private pools are not counted against the cap.
    `nbytes` is a whole number of bytes, 0 or more: anything else raises ValueError (a negative number would
    reach the library as a cap of 2**64 - 1 bytes, which caps nothing)."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"umm_torch.set_limit({nbytes!r}): the cap is a whole number of bytes, 0 (no cap) or more")
    if load().umm_set_limit(-1 if device is None else _device_index(device), int(nbytes)) != 0:
        raise RuntimeError(last_error())


def trace_flush():
    """Writes the allocations umm recorded for UMM_TRACE so far to the trace file, which then holds a complete
    trace up to now. umm also writes them out every 16,384 ops, in empty_cache() and when Python exits normally;
    call this before os._exit() or to read the trace while the program runs. Does nothing without UMM_TRACE."""
    lib = load()
    if lib.umm_trace_flush() != 0:
        raise RuntimeError(last_error() or "umm_trace_flush failed")
