"""Every ``distrain.*`` path README.md and docs/*.md name resolves: its module part imports and
the rest are attributes (``distrain.models.gpt.plan.gpt_tp_plan``). Current paths import
silently; old paths (moved in a redesign) keep working for one release through a thin shim
that warns with DeprecationWarning naming the new path and imports only that new module: the
one table distrain.moved.MOVED and its finder answer for every old path, no file does."""

from __future__ import annotations

import ast
import fcntl
import importlib
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from distrain import moved
from test_import_graph import parsed  # every source file's tree, parsed once per test process (its checks parse all)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "distrain"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a dotted path starting at the package (not `.distrain.lock`, not a name such as "distrain.full/1",
# not a quoted string value such as the byte tokenizer's {"type": "distrain.byte"})
PATH = re.compile(r"(?<![\w./\"-])distrain(?:\.[A-Za-z_]\w*)+(?![\w/\"])")

# old public module -> its new module (git log --diff-filter=DR -- src/distrain: the parallel/
# redesign in 8aa7d25, the transports of b6058dd, comm/ as core/ algorithms/ shm/, models/ and
# bench/ as folders): the one table, answered by the finder of distrain/moved.py, not by files
ALL_OLD = dict(moved.MOVED)


def documented_paths() -> dict[str, list[str]]:
    """{dotted path: the documents naming it} over README.md and docs/*.md."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for path in PATH.findall(doc.read_text()):
            found.setdefault(path, [])
            if doc.name not in found[path]:
                found[path].append(doc.name)
    return found


def _deprecated_module(path: str) -> str | None:
    return next((old for old in ALL_OLD if path == old or path.startswith(old + ".")), None)


# run in a fresh interpreter: each path's first import, with every warning it raises recorded
RESOLVE = r"""
import importlib, importlib.util, json, sys, types, warnings
import torch  # noqa: F401 -- torch's own import-time warnings are not distrain's
deprecated = set(json.loads(sys.argv[1]))
result = {}
for path in json.loads(sys.argv[2]):
    parts = path.split(".")
    for old in deprecated:  # a shim warns on its first import: make every path that uses it the first
        if path == old or path.startswith(old + "."):
            sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        error, kind = None, None
        try:
            obj, name = importlib.import_module(parts[0]), parts[0]
            for part in parts[1:]:
                sub = f"{name}.{part}"
                if isinstance(obj, types.ModuleType) and hasattr(obj, "__path__") and importlib.util.find_spec(sub):
                    obj = importlib.import_module(sub)
                else:
                    obj = getattr(obj, part)
                name = sub
            kind = type(obj).__name__
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
    result[path] = {"error": error, "kind": kind,
                    "warnings": [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught]}
print(json.dumps(result))
"""


def _resolve() -> dict:
    paths = sorted(documented_paths())
    proc = subprocess.run([sys.executable, "-c", RESOLVE, json.dumps(sorted(ALL_OLD)), json.dumps(paths)],
                          capture_output=True, text=True, timeout=90, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict:
    """RESOLVE's answer, once per session: under pytest-xdist each test process that runs some of these tests
    would run the module fixture (a fresh interpreter importing torch and every path), so the first one writes it
    into the session's folder that the workers share and the others read it (under a lock, while it is written)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _resolve()
    shared = tmp_path_factory.getbasetemp().parent / "module-paths-resolved.json"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            return json.loads(shared.read_text())
        result = _resolve()
        shared.write_text(json.dumps(result))
        return result


def test_the_documents_name_paths():
    found = documented_paths()
    # the scan finds what the documents are known to name (a broken regex would find nothing)
    for path in ("distrain.parallel.parameter_server", "distrain.models.gpt.plan.gpt_tp_plan", "distrain.comm",
                 "distrain.parallel.zero.memory", "distrain.Topology.from_world"):
        assert path in found, f"{path} not found in README.md/docs/*.md"
    assert "distrain.lock" not in found  # `<out>/.distrain.lock` is a file, not a module path
    assert len(found) >= 30


@pytest.mark.timeout(100)
@pytest.mark.parametrize("path", sorted(documented_paths()))
def test_documented_path_resolves(resolved, path):
    got = resolved[path]
    docs = ", ".join(documented_paths()[path])
    assert got["error"] is None, f"{path} (named in {docs}) does not resolve: {got['error']}"
    old = _deprecated_module(path)
    if old is None:
        assert got["warnings"] == [], f"{path} (named in {docs}) warns on import: {got['warnings']}"
    else:  # documents should name the new path; if one names an old one, the old one must still warn
        assert any(w.startswith("DeprecationWarning: ") and ALL_OLD[old] in w for w in got["warnings"]), \
            f"{path} (named in {docs}) is deprecated but its import did not warn: {got['warnings']}"


@pytest.mark.parametrize("old", sorted(ALL_OLD))
def test_old_path_warns_and_is_the_new_module(old):
    new = importlib.import_module(ALL_OLD[old])
    sys.modules.pop(old, None)  # its first import warns (an earlier test may have imported it)
    with pytest.warns(DeprecationWarning) as record:
        __import__(old)  # an import statement's own call (importlib.import_module would be the importer)
    shim = sys.modules[old]
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert messages == [f"{old} is deprecated and will be removed in the next release; import {ALL_OLD[old]} "
                        f"instead"]
    assert record[0].filename == __file__  # the importing line's (so a script's own import shows it by default)
    assert shim.__all__, old
    for name in shim.__all__:  # the same objects, not copies
        assert getattr(shim, name) is getattr(new, name), f"{old}.{name}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        importlib.import_module(old)  # once imported, later imports are silent (as for any module)


def test_moved_names_say_where_they_went():
    import distrain.parallel.pipeline_timeline as timeline
    import distrain.parallel.tensor as tensor

    with pytest.raises(AttributeError, match=r"^distrain\.parallel\.tensor\.check_tp_sizes moved to "
                                             r"distrain\.models\.gpt\.plan$"):
        tensor.check_tp_sizes  # noqa: B018
    with pytest.raises(AttributeError, match=r"^distrain\.parallel\.pipeline_timeline\.measure_bubbles moved to "
                                             r"distrain\.bench\.pipeline\.bubbles$"):
        timeline.measure_bubbles  # noqa: B018
    with pytest.raises(AttributeError, match=r"module 'distrain\.parallel\.tensor' has no attribute 'nothing'"):
        tensor.nothing  # noqa: B018


def _old_file(old: str) -> Path:
    return SRC.joinpath(*old.split(".")[1:])


def _imports(path: Path) -> set[str]:
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    return imported


@pytest.mark.parametrize("old", sorted(ALL_OLD))
def test_shim_imports_only_its_new_module(old):
    """No import cycle can go through a shim: the finder's module imports the standard library only, and
    importing an old path loads its new module (and what that imports), nothing else."""
    imported = _imports(SRC / "moved.py")
    assert imported <= {"__future__", "importlib", "importlib.abc", "importlib.util", "sys", "types", "warnings"}, \
        f"distrain/moved.py imports {sorted(imported)}"
    importlib.import_module(ALL_OLD[old])
    sys.modules.pop(old, None)
    before = set(sys.modules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        importlib.import_module(old)
    parents = {old.rsplit(".", k)[0] for k in range(1, old.count("."))} & set(ALL_OLD)  # old packages on the way
    loaded = set(sys.modules) - before
    assert old in loaded and loaded <= {old} | parents, f"importing {old} loaded {sorted(loaded - {old} - parents)}"


# an import statement of an old path (one regular expression for all of them: one search per file, not 43)
OLD_IMPORT = re.compile(rf"^\s*(from|import) ({'|'.join(map(re.escape, ALL_OLD))})\b(?!\.)", re.M)


def _old_imports(text: str) -> list[str]:
    """The old paths that ``text`` imports (``from OLD import``, ``import OLD``; not OLD.sub), in ALL_OLD's order."""
    found = {m.group(2) for m in OLD_IMPORT.finditer(text)}
    return [old for old in ALL_OLD if old in found]


def test_the_old_import_scan_sees_each_form():
    """(a scan that finds nothing proves nothing)"""
    old, other = sorted(ALL_OLD)[:2]
    assert _old_imports(f"import os\nfrom {old} import x\n    import {other} as y\n") == \
        [o for o in ALL_OLD if o in (old, other)]
    assert _old_imports(f"from {old}x import y\nfrom {old}._no_such_module import z\n# import {old}\n") == []


def test_every_shim_is_listed():
    """No module's docstring says it is deprecated and no file or folder lives at an old path (the finder
    answers for every one, so the tests above cover them all), and nothing in distrain imports an old path."""
    shims = set()
    for f in SRC.rglob("*.py"):
        doc = ast.get_docstring(parsed(f)) or ""
        if doc.startswith("Deprecated"):
            shims.add(".".join(("distrain", *f.relative_to(SRC).with_suffix("").parts)))
    assert shims == set()
    files = [old for old in ALL_OLD if _old_file(old).with_suffix(".py").exists() or _old_file(old).is_dir()]
    assert files == []
    users = [f"{f.relative_to(ROOT)} imports {old}" for f in SRC.rglob("*.py") for old in _old_imports(f.read_text())]
    assert users == []
