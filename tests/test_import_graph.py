"""The layering of src/distrain, checked on every import statement (lazy ones inside functions too).

Each module belongs to a layer (LAYERS, longest prefix wins); a module may import its own layer
or a lower one, never a higher one, and the import graph has no circle at all. So comm's core
never reaches into shm/ or an algorithm, parallel/ never into a model, and nothing but
``__main__`` imports the CLI. A source file over MAX_LINES lines is a warning, not a failure
(pytest's warnings summary lists them). ``python tests/test_import_graph.py`` prints the layer
graph and the long files.
"""

from __future__ import annotations

import ast
import sys
import warnings
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "distrain"
MAX_LINES = 400

# module prefix -> rank; a module may import modules of the same or a lower rank. Two layers that
# share a rank are siblings and may not import each other (comm.algorithms and comm.shm).
LAYERS: dict[str, int] = {
    "distrain.errors": 0,
    "distrain.topology": 1, "distrain.blame": 1, "distrain.lifeline": 1, "distrain.runlock": 1,
    "distrain.optim": 1, "distrain.factories": 1,
    "distrain.sealed": 1,  # the job secret and the sealed store (torch, cryptography, errors)
    "distrain.rendezvous": 2,  # torchrun's rendezvous on one address, its state tagged with the job secret (sealed)
    "distrain.checkpoint.form": 1,  # the whole-model format alone (torch, errors): ZeRO in parallel/ speaks it
    "distrain.comm.core": 2,
    "distrain.comm.algorithms": 3, "distrain.comm.shm": 3,
    "distrain.comm": 4,  # the torch.distributed-shaped surface: dispatch, api, forms, ...
    "distrain.runtime": 5,
    "distrain.launch": 6,
    "distrain.parallel": 7, "distrain.elastic": 7,  # elastic: the top process and the ranks' quorum, on launch
    "distrain.models": 8, "distrain.data": 8,
    "distrain.costmodel": 9, "distrain.checkpoint": 9,  # checkpoint: sets, resharding, import/export, --init-from
    "distrain.trainer": 10,
    "distrain.cluster": 11,
    "distrain": 12,  # the package's own __init__ (the Python API), generate, and moved (the old-path
    # finder: it imports its targets through importlib, which no import statement shows)
    "distrain.bench": 13,
    "distrain.cli": 14,
    "distrain.__main__": 15,
}


def modules() -> dict[str, Path]:
    """Every module: the .py files, and each C++ extension by its source (``_dataplane.cpp`` builds
    ``_dataplane``): an extension imports no distrain module, so it is a leaf of the graph."""
    out = {}
    for p in [*SRC.rglob("*.py"), *SRC.rglob("*.cpp")]:
        parts = list(p.relative_to(SRC.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _targets(mod: str, node, is_pkg: bool, known) -> list[str]:
    """The distrain modules an import statement loads (``from a import b``: a.b when b is a module)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:  # relative: resolve against this module's package
            base = mod.split(".") if is_pkg else mod.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            node_mod = ".".join(base + ([node.module] if node.module else []))
        else:
            node_mod = node.module or ""
        names = [f"{node_mod}.{a.name}" if f"{node_mod}.{a.name}" in known else node_mod for a in node.names]
    out = []
    for name in names:
        while name not in known and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in known and name.startswith("distrain"):
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for mod, path in known.items():
        if path.suffix != ".py":
            graph[mod] = set()
            continue
        tree = ast.parse(path.read_text(), str(path))
        graph[mod] = {t for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
                      for t in _targets(mod, n, path.name == "__init__.py", known) if t != mod}
    return graph


def layer(mod: str) -> str:
    return max((p for p in LAYERS if mod == p or mod.startswith(p + ".")), key=len)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a in sorted(graph):
        la = layer(a)
        for b in sorted(graph[a]):
            lb = layer(b)
            if LAYERS[lb] > LAYERS[la] or (LAYERS[lb] == LAYERS[la] and lb != la):
                bad.append(f"{a} ({la}, rank {LAYERS[la]}) imports {b} ({lb}, rank {LAYERS[lb]})")
    return bad


def test_every_module_has_a_layer():
    assert all(layer(m) for m in import_graph())
    assert set(LAYERS) <= set(modules()), set(LAYERS) - set(modules())  # no stale layer names


def test_no_import_circle():
    found = circles(import_graph())
    assert found == [], "import circles (lazy imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_upward_import():
    bad = upward(import_graph())
    assert bad == [], "imports against the layering (see LAYERS):\n" + "\n".join(bad)


def _is_cli(mod: str) -> bool:
    """The CLI is the package distrain.cli: any of its modules (distrain.cli.train, ...) counts as it."""
    return mod == "distrain.cli" or mod.startswith("distrain.cli.")


def test_only_main_imports_the_cli():
    users = sorted(m for m, deps in import_graph().items() if not _is_cli(m) and any(_is_cli(d) for d in deps))
    assert users == ["distrain.__main__"]


def long_files() -> dict[str, int]:
    """{path under src/distrain: lines} of every source file over MAX_LINES lines."""
    return {str(p.relative_to(SRC)): n for p in sorted(SRC.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}


def test_no_source_file_over_the_limit(tmp_path, monkeypatch):
    """A source file over MAX_LINES lines is a warning, not a failure (pytest's summary lists them until
    they are split); what can fail is the listing: exactly the files over the limit, with their counts,
    checked on a tree whose answer is known (one line over is listed, subfolders too; the limit is not)."""
    long = long_files()
    (tmp_path / "sub").mkdir()
    for name, n in (("at.py", MAX_LINES), ("over.py", MAX_LINES + 1), ("sub/deep.py", MAX_LINES + 7)):
        (tmp_path / name).write_text("x = 1\n" * n)
    (tmp_path / "long.txt").write_text("x\n" * (MAX_LINES + 1))  # not a source file
    monkeypatch.setitem(long_files.__globals__, "SRC", tmp_path)
    assert long_files() == {"over.py": MAX_LINES + 1, "sub/deep.py": MAX_LINES + 7}
    if long:  # a warning, not a failure: the summary lists them until they are split
        warnings.warn(UserWarning(f"split these modules (>{MAX_LINES} lines): {long}"))


def test_the_checker_sees_circles_and_upward_imports():
    """The checks above would fail on a bad graph (a checker that finds nothing proves nothing)."""
    graph = {"distrain.comm.core.group": {"distrain.comm.shm.transport"},
             "distrain.comm.shm.transport": {"distrain.comm.core.group", "distrain.comm.algorithms.ring"},
             "distrain.comm.algorithms.ring": set()}
    assert circles(graph) == [["distrain.comm.core.group", "distrain.comm.shm.transport"]]
    assert upward(graph) == [
        "distrain.comm.core.group (distrain.comm.core, rank 2) imports distrain.comm.shm.transport (distrain.comm.shm, rank 3)",
        "distrain.comm.shm.transport (distrain.comm.shm, rank 3) imports distrain.comm.algorithms.ring "
        "(distrain.comm.algorithms, rank 3)",
    ]
    # a lazy import inside a function is an edge like any other
    tree = ast.parse("def f():\n    from distrain.comm.core import registry\n")
    known = {"distrain.comm.core.registry": None, "distrain.comm.core": None, "distrain.comm.shm.hierarchy": None}
    assert _targets("distrain.comm.shm.hierarchy", tree.body[0].body[0], False, known) == ["distrain.comm.core.registry"]


def layer_summary(graph: dict[str, set[str]]) -> list[str]:
    edges = Counter((layer(a), layer(b)) for a in graph for b in graph[a] if layer(a) != layer(b))
    return [f"{a:28s} -> {b:28s} {n:3d} import(s)" for (a, b), n in sorted(edges.items(), key=lambda e: -LAYERS[e[0][0]])]


if __name__ == "__main__":
    g = import_graph()
    print(f"{len(g)} modules, {sum(map(len, g.values()))} import edges between them")
    print("\n".join(layer_summary(g)))
    print("circles:", circles(g) or "none")
    print("upward imports:", upward(g) or "none")
    print(f"files over {MAX_LINES} lines:", ", ".join(f"{f} ({n})" for f, n in long_files().items()) or "none")
    sys.exit(1 if circles(g) or upward(g) else 0)
