"""The C++ adapter between PyTorch and umm (allocator.cpp): umm as a CUDAAllocator of PyTorch's own
(umm_torch_install, used by enable()), which honours CUDA graphs' private pools, torch.cuda's statistics, snapshots
and CUDA IPC; and umm_torch_alloc for pool()'s CUDAPluggableAllocator, which throws torch.OutOfMemoryError with
umm's message where umm_alloc returns NULL (PyTorch does not check the pointer a pluggable allocator returns).

It is compiled against the installed PyTorch's headers on first use (a few seconds), and cached by PyTorch version,
C++ ABI and library path under $UMM_TORCH_CACHE or ~/.cache/umm_torch. UMM_TORCH_ADAPTER=off skips it.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

_SOURCE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "allocator.cpp")


def _source():
    with open(_SOURCE_PATH) as f:
        return f.read()


def _cache_dir():
    return os.environ.get("UMM_TORCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "umm_torch")


def build(lib_path):
    """Path of the adapter library for the umm library at lib_path, compiled if needed; None (with a warning)
    where it cannot be made, or where UMM_TORCH_ADAPTER=off."""
    if os.environ.get("UMM_TORCH_ADAPTER", "").strip().lower() in ("off", "0", "false", "no"):
        return None
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        return None
    stat = os.stat(lib_path)
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    key = hashlib.sha256(
        f"{torch.__version__}|{abi}|{os.path.realpath(lib_path)}|{stat.st_size}|{stat.st_mtime_ns}|{_source()}".encode()
    ).hexdigest()[:16]
    target = os.path.join(_cache_dir(), f"libumm_torch_adapter-{key}.so")
    if os.path.isfile(target):
        return target
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        _warn("no C++ compiler (c++, g++ or $CXX) was found")
        return None
    lib_dir = os.path.dirname(os.path.realpath(lib_path))
    torch_lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    try:
        includes = [f"-I{d}" for d in cpp_extension.include_paths("cuda")]
        libraries = [f"-L{d}" for d in cpp_extension.library_paths("cuda")]
    except (OSError, TypeError, RuntimeError) as e:  # no CUDA toolkit: its headers are needed
        _warn(f"the CUDA toolkit's headers were not found ({e})")
        return None
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as work:
        source = os.path.join(work, "adapter.cpp")
        with open(source, "w") as f:
            f.write(_source())
        output = os.path.join(work, "adapter.so")
        command = [compiler, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
                   source, "-o", output, f"-L{torch_lib}", *libraries, "-ltorch_cuda", "-lc10_cuda", "-lc10",
                   "-lcudart", f"-L{lib_dir}", "-lumm_capi",
                   f"-Wl,-rpath,{torch_lib}", f"-Wl,-rpath,{lib_dir}"]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            _warn(f"{compiler} failed to run: {e}")
            return None
        if done.returncode != 0:
            _warn(f"{compiler} failed:\n{done.stderr[-2000:]}")
            return None
        os.replace(output, target)  # atomic: a concurrent process sees the whole file or none
    return target


def _warn(why):
    warnings.warn(
        f"umm_torch: the adapter could not be built ({why}); enable() falls back to a CUDAPluggableAllocator: no "
        "private pools for CUDA graphs (do not capture graphs), no torch.cuda statistics or IPC, and an allocation "
        "umm cannot serve returns a null pointer that PyTorch does not check.",
        RuntimeWarning,
        stacklevel=3,
    )
    print(f"umm_torch: {why}", file=sys.stderr)
