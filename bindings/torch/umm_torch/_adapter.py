"""The C++ adapter between PyTorch's pluggable allocator and umm: umm_torch_alloc calls umm_alloc and, where it
returns NULL, throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python) with umm's message, or c10::Error for
other failures. PyTorch's CUDAPluggableAllocator does not check the pointer its alloc function returns, so without
the adapter a failed allocation becomes a tensor at address 0 and an illegal memory access later.

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

_SOURCE = r"""
#include <c10/util/Exception.h>
#include <string>
#include <sys/types.h>

extern "C" {
void* umm_alloc(ssize_t size, int device, void* stream);
const char* umm_last_error(void);

void* umm_torch_alloc(ssize_t size, int device, void* stream) {
  void* ptr = umm_alloc(size, device, stream);
  if (ptr == nullptr && size > 0) {
    const char* message = umm_last_error();
    std::string text = message ? message : "umm_alloc returned NULL without a message";
    if (text.find("out of memory") != std::string::npos) {
      TORCH_CHECK_WITH(OutOfMemoryError, false, text);
    }
    TORCH_CHECK(false, text);
  }
  return ptr;
}
}
"""


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
        f"{torch.__version__}|{abi}|{os.path.realpath(lib_path)}|{stat.st_size}|{stat.st_mtime_ns}|{_SOURCE}".encode()
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
    includes = [f"-I{d}" for d in cpp_extension.include_paths()]
    os.makedirs(_cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=_cache_dir()) as work:
        source = os.path.join(work, "adapter.cpp")
        with open(source, "w") as f:
            f.write(_SOURCE)
        output = os.path.join(work, "adapter.so")
        command = [compiler, "-shared", "-fPIC", "-O2", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", *includes,
                   source, "-o", output, f"-L{torch_lib}", "-lc10", f"-L{lib_dir}", "-lumm_capi",
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
        f"umm_torch: the out-of-memory adapter could not be built ({why}); under enable(), an allocation umm cannot "
        "serve returns a null pointer that PyTorch does not check. umm_torch.pool() raises torch.OutOfMemoryError "
        "without it.",
        RuntimeWarning,
        stacklevel=3,
    )
    print(f"umm_torch: {why}", file=sys.stderr)
