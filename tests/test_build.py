"""setup.py's decision about the compiled data plane: no C++ compiler, the Python kernels and one line;
a compiler, the build, and a build that fails fails the install (so a machine that can compile never
tests the fallback while its compiled-kernel tests skip). In-process on setup.py's functions, then
through pip on a copy of the sources in a temporary folder (a few seconds each: the broken copy
stops at its first line)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "src/distrain/comm/shm/_dataplane.cpp"


def load_setup():
    """setup.py as a module (it calls setup() only when run as __main__, as setuptools runs it)."""
    spec = importlib.util.spec_from_file_location("distrain_setup_py", ROOT / "setup.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.timeout(60)
def test_no_compiler_falls_back_with_one_line_and_builds_nothing(capsys):
    setup_py, calls = load_setup(), []
    assert setup_py.build_or_fall_back(None, lambda: calls.append("built")) is False
    assert calls == []
    assert capsys.readouterr().err == ("distrain: no C++ compiler ($CXX, else c++, is not on PATH): the shared-memory "
                                       "data plane is not built; the transport uses its Python version\n")


@pytest.mark.timeout(60)
def test_a_compiler_builds(capsys):
    setup_py, calls = load_setup(), []
    assert setup_py.build_or_fall_back("/usr/bin/c++", lambda: calls.append("built")) is True
    assert calls == ["built"]
    assert capsys.readouterr().err == ("distrain: built the C++ shared-memory data plane "
                                       "(distrain.comm.shm._dataplane) with /usr/bin/c++\n")


@pytest.mark.timeout(60)
def test_a_compiler_and_a_failed_build_raise():
    setup_py = load_setup()
    failure = subprocess.CalledProcessError(1, ["ninja", "-v"])

    def build():
        raise failure

    with pytest.raises(setup_py.DataPlaneBuildError) as info:
        setup_py.build_or_fall_back("/usr/bin/c++", build)
    assert info.value.__cause__ is failure
    assert str(info.value).startswith(f"the C++ shared-memory data plane ({SOURCE}) did not compile with /usr/bin/c++ "
                                      f"(CalledProcessError: Command '['ninja', '-v']' returned non-zero exit "
                                      f"status 1.)")
    assert str(info.value).endswith("run the install with CXX=none (then the transport uses its Python version)")


@pytest.mark.timeout(60)
def test_the_compiler_is_the_one_torch_would_run():
    setup_py = load_setup()
    assert setup_py.cxx_compiler({}) == shutil.which("c++")  # torch's default on Linux
    assert setup_py.cxx_compiler({"CXX": "none"}) is None
    assert setup_py.cxx_compiler({"CXX": ""}) is None
    # CXX="ccache g++" runs its first word
    assert setup_py.cxx_compiler({"CXX": f"{sys.executable} -x"}) == shutil.which(sys.executable)


def _copy_sources(dest: Path) -> Path:
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    shutil.copytree(ROOT / "src", dest / "src", ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    return dest


def _pip(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args, "--no-build-isolation", "--no-deps", "-v", "."],
                          cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("c++") is None, reason="needs a C++ compiler (c++ on PATH)")
def test_pip_fails_when_the_source_does_not_compile(tmp_path):
    src = _copy_sources(tmp_path) / SOURCE
    # a missing header is a fatal error on the first line: the compiler stops before torch's headers
    src.write_text("#include <distrain_deliberately_missing_header.h>\n" + src.read_text())
    res = _pip(["wheel", "-w", str(tmp_path / "wheels")], tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    assert "distrain_deliberately_missing_header.h: No such file or directory" in out
    assert f"DataPlaneBuildError: the C++ shared-memory data plane ({SOURCE}) did not compile" in out
    assert not (tmp_path / "wheels").exists() or not list((tmp_path / "wheels").iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pip_without_a_compiler_installs_the_python_kernels(tmp_path):
    _copy_sources(tmp_path)
    res = _pip(["wheel", "-w", str(tmp_path / "wheels")], tmp_path, CXX="none")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert "distrain: no C++ compiler ($CXX, else c++, is not on PATH)" in out
    (wheel,) = (tmp_path / "wheels").glob("distrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "distrain/comm/shm/compiled.py" in names and not [n for n in names if n.endswith(".so")]
