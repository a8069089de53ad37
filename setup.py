"""Build of the one compiled piece: the shared-memory data plane (src/distrain/comm/shm/_dataplane.cpp).

Everything else is in pyproject.toml. The extension is optional: with no C++ compiler, or no torch
at build time (an isolated build), the install goes on without it, says so in one line, and the
transport runs its Python version (distrain.comm.shm.compiled says which is in use). ``make install``
builds it with ``pip install --no-build-isolation``, so the torch it compiles against is the one
installed first (torch==2.13.0).

Flags: -O3 and this machine's instruction set (-march=native: the vector reductions use AVX2 /
AVX-512 where the CPU has them; the build is made on the machine it runs on), -fwrapv (integer sums
wrap as in torch).
"""

import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

NAME = "distrain.comm.shm._dataplane"
SOURCE = "src/distrain/comm/shm/_dataplane.cpp"


def say(msg: str) -> None:
    print(f"distrain: {msg}", file=sys.stderr, flush=True)


try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # an isolated build environment has no torch: nothing to compile against
    BuildExtension = CppExtension = None


class OptionalBuild(BuildExtension if BuildExtension is not None else build_ext):
    """Build the data plane if possible; otherwise one line and the Python version."""

    def run(self):
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - any failure to compile leaves the Python path
            say(f"the C++ shared-memory data plane was not built ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                f"the transport uses its Python version")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
            say(f"built the C++ shared-memory data plane ({NAME})")
        except Exception as e:  # noqa: BLE001
            say(f"the C++ shared-memory data plane was not built ({type(e).__name__}); the transport uses its "
                f"Python version")


def extensions():
    if CppExtension is None:
        say("torch is not importable at build time (use pip install --no-build-isolation); the shared-memory "
            "transport uses its Python version")
        return []
    return [CppExtension(NAME, [SOURCE], extra_compile_args=["-O3", "-march=native", "-fwrapv"], optional=True)]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuild})
