"""The layering of src/distrain, checked on every import statement (lazy ones inside functions too),
and the privacy of its names.

Each module belongs to a layer (LAYERS, longest prefix wins); a module may import its own layer
or a lower one, never a higher one, and the import graph has no circle at all. So comm's core
never reaches into shm/ or an algorithm, parallel/ never into a model, and nothing but
``__main__`` imports the CLI. A source file over MAX_LINES lines is a warning, not a failure
(pytest's warnings summary lists them). ``python tests/test_import_graph.py`` prints the layer
graph, the long files and the private reaches.

A name with a leading underscore is its module's own: no other module imports it (``from x import
_y``, lazy imports too), reads it off the module (``x._y``), names it in getattr/setattr/hasattr,
or reads or writes another object's private field (``obj._y`` where this module defines no ``_y``).
What one module needs from another gets a public name there. Dunders, torch's and the standard
library's own underscore names (THIRD_PARTY_PRIVATE, each with its reason) and a package's private
submodule imported inside that package are no reaches.
"""

from __future__ import annotations

import ast
import functools
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
    "distrain.entry": 1,  # launched_rank and leave, without torch: every command's entry point asks both
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


def parsed(path: Path) -> ast.AST:
    """The syntax tree of a source file, parsed once per test process for each (path, mtime, size): five
    checks read every file's tree, and parsing and walking them all took 2-7 s each time (trees only read)."""
    st = path.stat()
    return _parse(path, st.st_mtime_ns, st.st_size)


def import_nodes(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every import statement of a source file (lazy ones in functions included), as :func:`parsed`."""
    st = path.stat()
    return _imports(path, st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=None)
def _parse(path: Path, mtime_ns: int, size: int) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


@functools.lru_cache(maxsize=None)
def _imports(path: Path, mtime_ns: int, size: int) -> tuple[ast.Import | ast.ImportFrom, ...]:
    return tuple(n for n in ast.walk(_parse(path, mtime_ns, size)) if isinstance(n, (ast.Import, ast.ImportFrom)))


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {}
    for mod, path in known.items():
        if path.suffix != ".py":
            graph[mod] = set()
            continue
        graph[mod] = {t for n in import_nodes(path) for t in _targets(mod, n, path.name == "__init__.py", known)
                      if t != mod}
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


# ---------------------------------------------------------------------------------------
# Private names stay in their module
# ---------------------------------------------------------------------------------------

# Underscore names of torch and the standard library that distrain uses on purpose (name: why).
THIRD_PARTY_PRIVATE = {
    "_ddp_params_and_buffers_to_ignore": "torch DDP's documented attribute: what DDP leaves alone",
    "_parameters": "nn.Module's parameter dict (ZeRO-3 takes a parameter away from its module)",
    "_execution_engine": "torch.autograd's engine: queue_callback, a hook at the end of backward",
    "_source_rank": "torch Work's sender of an any-source receive",
    "_asdict": "a namedtuple's public method",
    "_create_tcp_store_server": "torch's dynamic rendezvous hook for the store it serves",
    "_decode_state": "torch's rendezvous backend method our sealed backend overrides",
    "_actions": "argparse: the parser's actions (the sub-command list)",
    "_mmap": "numpy memmap's mapping (closed at once instead of at garbage collection)",
    "_inheriting": "multiprocessing: a spawned child still unpickling its parent's state",
}


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(tree: ast.AST) -> set[str]:
    """The names a module defines itself: functions, classes, assigned names, and fields it sets on
    ``self``/``cls``."""
    own = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            own.add(n.id)
        elif isinstance(n, ast.arg):
            own.add(n.arg)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) and _is_self(n.value):
            own.add(n.attr)
    return own


def _is_self(expr) -> bool:
    return isinstance(expr, ast.Name) and expr.id in ("self", "cls")


def _resolve_from(mod: str, node: ast.ImportFrom, is_pkg: bool) -> str:
    if not node.level:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def private_reaches_in(mod: str, tree: ast.AST, is_pkg: bool, known) -> list[tuple[int, str]]:
    """(line, what) for every reach of module ``mod`` into another module's or object's private
    names, and every attribute it sets on another distrain module (monkey-patching)."""
    out, modules_, foreign = [], {}, set()  # local name -> distrain module; names bound to other imports
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            src = _resolve_from(mod, n, is_pkg)
            for a in n.names:
                local = a.asname or a.name
                if not src.startswith("distrain"):
                    foreign.add(local)
                    continue
                if f"{src}.{a.name}" in known:
                    modules_[local] = f"{src}.{a.name}"
                private_submodule = f"{src}.{a.name}" in known and (mod == src or mod.startswith(src + "."))
                if _is_private(a.name) and src != mod and not private_submodule:
                    out.append((n.lineno, f"from {src} import {a.name}"))
        elif isinstance(n, ast.Import):
            for a in n.names:
                local = a.asname or a.name.split(".")[0]
                if a.name.startswith("distrain"):
                    modules_[local] = a.name if a.asname else "distrain"
                else:
                    foreign.add(local)

    def module_of(expr) -> str | None:
        parts = []
        while isinstance(expr, ast.Attribute):
            parts.append(expr.attr)
            expr = expr.value
        if isinstance(expr, ast.Name) and expr.id in modules_:
            name = ".".join([modules_[expr.id], *reversed(parts)])
            return name if name in known else None
        return None

    def root(expr):
        while isinstance(expr, (ast.Attribute, ast.Call, ast.Subscript)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        return expr.id if isinstance(expr, ast.Name) else None

    own = _own_names(tree)
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute):
            owner = module_of(n.value)
            if owner is not None:
                if owner != mod and isinstance(n.ctx, (ast.Store, ast.Del)):
                    out.append((n.lineno, f"sets {owner}.{n.attr}"))
                elif owner != mod and _is_private(n.attr):
                    out.append((n.lineno, f"{owner}.{n.attr}"))
            elif (_is_private(n.attr) and not _is_self(n.value) and root(n.value) not in foreign
                  and n.attr not in own and n.attr not in THIRD_PARTY_PRIVATE):
                out.append((n.lineno, f"{ast.unparse(n)} (a field this module does not define)"))
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(n.args) >= 2
              and isinstance(n.args[1], ast.Constant) and isinstance(n.args[1].value, str)):
            name = n.args[1].value
            if (_is_private(name) and not _is_self(n.args[0]) and root(n.args[0]) not in foreign and name not in own
                    and name not in THIRD_PARTY_PRIVATE):
                out.append((n.lineno, f"{n.func.id}({ast.unparse(n.args[0])}, {name!r}) (a field this module does "
                                      f"not define)"))
    return sorted(set(out))


def private_reaches() -> list[str]:
    """'path: what' (path under src/distrain, no line number) of every private reach in src/distrain."""
    known = modules()
    out = []
    for mod, path in sorted(known.items()):
        if path.suffix != ".py":
            continue
        tree = parsed(path)
        rel = path.relative_to(SRC)
        out += [f"{rel}:{line}: {what}" for line, what in private_reaches_in(mod, tree, path.name == "__init__.py",
                                                                                known)]
    return out


# Reaches accepted for now, by ``path: reach`` (none: a reach gets a public name in its owner instead).
ALLOWED: set[str] = set()  # (none: a reach is given a public name in its owner, not allowed here)


def _without_line(reach: str) -> str:
    path, _, rest = reach.split(":", 2)
    return f"{path}:{rest}"


def test_no_private_name_crosses_a_module():
    reaches = private_reaches()
    bad = [r for r in reaches if _without_line(r) not in ALLOWED]
    assert bad == [], "private names reached across modules (give them a public name in their owner):\n" + \
        "\n".join(bad)
    stale = ALLOWED - {_without_line(r) for r in reaches}
    assert not stale, f"allowed reaches that no longer exist (remove them from ALLOWED): {sorted(stale)}"


def test_the_checker_sees_private_reaches():
    """Each kind of reach in a synthetic module is found (a checker that finds nothing proves nothing)."""
    src = (
        "import torch\n"
        "from distrain.comm import api\n"
        "from distrain.comm.dispatch import _run, CommHandle\n"
        "import distrain.comm.core.watchdog as wd\n"
        "def f(ddp, p, self):\n"
        "    from distrain.parallel.tensor_parallel.group import _tp\n"
        "    api._tensor(p)\n"
        "    self.ddp._join = True\n"
        "    wd.current = None\n"
        "    torch._C\n"
        "    p._mine\n"
        "    self._x = getattr(p, '_expert_parallel', False)\n"
        "class K:\n"
        "    def _mine(self):\n"
        "        return self._x, ddp._parameters\n"
    )
    known = {m: None for m in ("distrain.comm.api", "distrain.comm.dispatch", "distrain.comm.core.watchdog",
                                "distrain.parallel.tensor_parallel.group", "distrain.bench.x")}
    assert private_reaches_in("distrain.bench.x", ast.parse(src), False, known) == [
        (3, "from distrain.comm.dispatch import _run"),
        (6, "from distrain.parallel.tensor_parallel.group import _tp"),
        (7, "distrain.comm.api._tensor"),
        (8, "self.ddp._join (a field this module does not define)"),
        (9, "sets distrain.comm.core.watchdog.current"),
        (12, "getattr(p, '_expert_parallel') (a field this module does not define)"),
    ]
    # the owner itself may use its private names
    assert private_reaches_in("distrain.comm.dispatch", ast.parse("from distrain.comm.dispatch import _run\n"),
                              False, {"distrain.comm.dispatch": None}) == []


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
    print("private reaches:", "\n  ".join(["", *private_reaches()]) or "none")
    sys.exit(1 if circles(g) or upward(g) else 0)
