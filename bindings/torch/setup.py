"""Builds the umm-torch wheel: the umm_torch package plus libumm_capi.so, compiled from ../../capi by cargo
(setuptools-rust). The library is loaded with ctypes, not imported, so the wheel fits every CPython 3 on the
platform it was built for (tag py3-none-<platform>)."""

import os

from setuptools import setup
from setuptools_rust import Binding, RustExtension
from setuptools_rust.build import build_rust

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))


class PlatformWheel(bdist_wheel):
    """A wheel for one platform and any Python 3: the package holds no extension module."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


class PlainLibraryName(build_rust):
    """Names the library libumm_capi.so, as umm_torch looks for it, rather than with CPython's extension suffix
    (it is a C library loaded with ctypes, the same for every Python)."""

    def get_dylib_ext_path(self, ext, target_fname):
        path = super().get_dylib_ext_path(ext, target_fname)
        return os.path.join(os.path.dirname(path), "libumm_capi.so")


setup(
    rust_extensions=[
        RustExtension(
            "umm_torch.libumm_capi",
            path=os.path.join(HERE, "..", "..", "capi", "Cargo.toml"),
            binding=Binding.NoBinding,
            debug=False,
        )
    ],
    cmdclass={"bdist_wheel": PlatformWheel, "build_rust": PlainLibraryName},
    zip_safe=False,
)
