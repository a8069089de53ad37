"""Build of the one compiled piece: the shared-memory data plane (src/distrain/comm/shm/_dataplane.cpp).

Everything else is in pyproject.toml. ``make install`` builds it with ``pip install
--no-build-isolation``, so the torch it compiles against is the one installed first (torch==2.13.0).

Where it is built (:func:`build_or_fall_back`):

* a C++ compiler is found (the one torch's cpp_extension runs: ``$CXX``, else ``c++``): the
  extension is built, and a build that fails fails the install. A machine that can compile must
  not go on quietly with the Python kernels: every compiled-kernel test would skip and the
  suite would pass on the fallback.
* no compiler: the install goes on without the extension, says so in one line, and the transport
  runs its Python version (distrain.comm.shm.compiled says which is in use). This is also the way
  to install without it on a machine that has a compiler: ``CXX=none pip install ...``.
* no torch at build time (an isolated build, ``pip install .`` without ``--no-build-isolation``):
  nothing to compile against; one line, and the Python version.

Flags: -O3 and this machine's instruction set (-march=native: the vector reductions use AVX2 /
AVX-512 where the CPU has them; the build is made on the machine it runs on), -fwrapv (integer sums
wrap as in torch).
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Callable

from setuptools import setup
from setuptools.command.build_ext import build_ext

NAME = "distrain.comm.shm._dataplane"
SOURCE = "src/distrain/comm/shm/_dataplane.cpp"
FALLBACK = "the transport uses its Python version"


class DataPlaneBuildError(RuntimeError):
    """A C++ compiler is there, but the data plane did not compile."""


def say(msg: str) -> None:
    print(f"distrain: {msg}", file=sys.stderr, flush=True)


try:
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # an isolated build environment has no torch: nothing to compile against
    BuildExtension = CppExtension = None


def cxx_compiler(environ: dict[str, str] | None = None) -> str | None:
    """The path of the C++ compiler torch's cpp_extension would run on Linux (``$CXX``, else ``c++``;
    its first word, as ``CXX="ccache g++"`` runs ccache), or None where that is not on PATH."""
    words = shlex.split((os.environ if environ is None else environ).get("CXX", "c++"))
    return shutil.which(words[0]) if words else None


def build_or_fall_back(compiler: str | None, build: Callable[[], None]) -> bool:
    """The decision of this file: with no ``compiler`` (None), one line and False (the Python kernels);
    with one, ``build()``: True when it built, and :class:`DataPlaneBuildError` when it failed."""
    if compiler is None:
        say(f"no C++ compiler ($CXX, else c++, is not on PATH): the shared-memory data plane is not built; {FALLBACK}")
        return False
    try:
        build()
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise DataPlaneBuildError(
            f"the C++ shared-memory data plane ({SOURCE}) did not compile with {compiler} ({type(e).__name__}: "
            f"{first}); the compiler's errors are above. To install without it, run the install with CXX=none "
            f"(then {FALLBACK})") from e
    say(f"built the C++ shared-memory data plane ({NAME}) with {compiler}")
    return True


class DataPlaneBuild(BuildExtension if BuildExtension is not None else build_ext):
    """build_ext through :func:`build_or_fall_back`: no compiler, nothing built; a failed build, an error."""

    def run(self) -> None:
        build_or_fall_back(cxx_compiler(), super().run)


def extensions() -> list:
    if CppExtension is None:
        say(f"torch is not importable at build time (use pip install --no-build-isolation); {FALLBACK}")
        return []
    return [CppExtension(NAME, [SOURCE], extra_compile_args=["-O3", "-march=native", "-fwrapv"])]


if __name__ == "__main__":  # (setuptools runs this file as __main__; tests import it for the functions above)
    setup(ext_modules=extensions(), cmdclass={"build_ext": DataPlaneBuild})
