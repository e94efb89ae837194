"""umm as PyTorch's CUDA allocator, in one call.

    import umm_torch
    umm_torch.enable()                  # before anything allocates CUDA memory
    ...train...
    print(umm_torch.memory_stats())     # umm's statistics under torch.cuda.memory_stats()'s key names

enable() loads libumm_capi.so (built with `cargo build --release -p umm-capi`) through
torch.cuda.memory.CUDAPluggableAllocator and makes it the current allocator. PyTorch's own statistics
functions (torch.cuda.memory_stats, max_memory_reserved, ...) raise under a pluggable allocator, and
torch.cuda.empty_cache() does nothing there: use the functions of this module instead. They fall back to
torch.cuda's when umm is not enabled, so code can call them either way.
"""

import ctypes
import json
import os

_LIB_NAME = "libumm_capi.so"
_lib = None
_lib_path = None


def _candidates():
    env = os.environ.get("UMM_CAPI_LIB")
    if env:
        yield env
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    yield os.path.join(here, _LIB_NAME)
    for target in (os.environ.get("CARGO_TARGET_DIR"), os.path.join(root, "target")):
        if target:
            yield os.path.join(target, "release", _LIB_NAME)
    yield os.path.join(root, ".device", "capi", _LIB_NAME)


def find_library():
    """Path of libumm_capi.so: $UMM_CAPI_LIB, next to this file, or the workspace's target/release."""
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
    _lib, _lib_path = lib, path
    return lib


def enable(path=None):
    """Makes umm PyTorch's CUDA allocator. Call before the first CUDA allocation of the process (PyTorch
    refuses to swap an allocator that has been used). Returns the library path."""
    import torch

    lib = load(path)
    allocator = torch.cuda.memory.CUDAPluggableAllocator(_lib_path, "umm_alloc", "umm_free")
    torch.cuda.memory.change_current_allocator(allocator)
    return _lib_path


def enabled():
    """Whether enable() made umm the allocator of this process."""
    return _lib is not None and _allocator_is_pluggable()


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
        import torch

        return torch.cuda.current_device()
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


def memory_stats(device=None):
    """umm's statistics under the key names of torch.cuda.memory_stats() ("reserved_bytes.all.peak", ...),
    or torch.cuda.memory_stats() itself when umm is not the allocator."""
    if not enabled():
        import torch

        return torch.cuda.memory_stats(device)
    s = umm_stats(device)
    out = {}
    for key in ("allocated_bytes", "requested_bytes", "reserved_bytes", "active_bytes", "inactive_split_bytes"):
        for part in ("current", "peak"):
            out[f"{key}.all.{part}"] = s[key][part]
    out["active.all.current"] = s["active_blocks"]["current"]
    out["active.all.peak"] = s["active_blocks"]["peak"]
    out["segment.all.current"] = s["segments"]["current"]
    out["segment.all.peak"] = s["segments"]["peak"]
    out["allocation.all.allocated"] = s["num_allocs"]
    out["allocation.all.freed"] = s["num_frees"]
    for key in ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free"):
        out[key] = s[key]
    out["umm.cache_hits"] = s["cache_hits"]
    out["umm.cache_misses"] = s["cache_misses"]
    out["umm.hit_rate"] = s["hit_rate"]
    out["umm.limit_bytes"] = s["limit_bytes"]
    out["umm.virtual_memory"] = s["virtual_memory"]
    return out


def _stat(key, part, torch_fn, device):
    if not enabled():
        import torch

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
    if not enabled():
        import torch

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
    allocator). Returns the bytes released (None under PyTorch's allocator)."""
    if not enabled():
        import torch

        torch.cuda.empty_cache()
        return None
    released = load().umm_empty_cache(-1 if device is None else _device_index(device))
    if released < 0:
        raise RuntimeError(last_error())
    return released


def set_limit(nbytes, device=None):
    """Caps the bytes umm reserves (0 removes the cap); past it, allocations fail like an out-of-memory."""
    if load().umm_set_limit(-1 if device is None else _device_index(device), int(nbytes)) != 0:
        raise RuntimeError(last_error())


def trace_flush():
    """Writes the allocations umm recorded for UMM_TRACE so far to the trace file, which then holds a complete
    trace up to now. umm also writes them out every 16,384 ops, in empty_cache() and when Python exits normally;
    call this before os._exit() or to read the trace while the program runs. Does nothing without UMM_TRACE."""
    lib = load()
    lib.umm_trace_flush.restype = ctypes.c_int
    lib.umm_trace_flush.argtypes = []
    if lib.umm_trace_flush() != 0:
        raise RuntimeError(last_error() or "umm_trace_flush failed")
