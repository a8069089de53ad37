"""Old flat module paths of distrain.comm, kept importable for one release.

Before comm/ became the core / algorithms / shm sub-packages, every module sat in comm/
itself. ``import distrain.comm.ring`` (or ``from distrain.comm.shm_coll import ...``) still
works: a finder on ``sys.meta_path`` answers for the old name with a thin module that
forwards every attribute to the new one and warns once (DeprecationWarning naming the new
path). Setting an attribute on the old module does not reach the new one: patch the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

# old name (under distrain.comm) -> new module path; the docs and the 0.x API named these
MOVED: dict[str, str] = {
    "util": "distrain.comm.core.util",
    "tags": "distrain.comm.core.tags",
    "ops": "distrain.comm.core.ops",
    "group": "distrain.comm.core.group",
    "torchargs": "distrain.comm.core.torchargs",
    "p2p": "distrain.comm.core.p2p",
    "ledger": "distrain.comm.core.ledger",
    "watchdog": "distrain.comm.core.watchdog",
    "registry": "distrain.comm.core.registry",
    "transports": "distrain.comm.core.transport",
    "transport": "distrain.comm.core.transport",
    "star": "distrain.comm.algorithms.star",
    "ring": "distrain.comm.algorithms.ring",
    "tree": "distrain.comm.algorithms.tree",
    "cost": "distrain.comm.algorithms.cost",
    "shm_segment": "distrain.comm.shm.segment",
    "shm_p2p": "distrain.comm.shm.p2p",
    "shm_coll": "distrain.comm.shm.collectives",
    "hierarchy": "distrain.comm.shm.hierarchy",
}
_PREFIX = "distrain.comm."


class _Forward(importlib.abc.Loader):
    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        target = importlib.import_module(self.new)
        mod = types.ModuleType(spec.name, f"Moved to {self.new}.")
        mod.__getattr__ = lambda name: getattr(target, name)  # PEP 562: every name is the new module's
        mod.__dir__ = lambda: dir(target)
        mod.__all__ = list(getattr(target, "__all__", None) or
                           [n for n in vars(target) if not n.startswith("_")
                            and not isinstance(getattr(target, n), types.ModuleType)])
        return mod

    def exec_module(self, module) -> None:
        # stacklevel 2 is the importing line: the warnings module skips importlib's own frames
        warnings.warn(f"{module.__name__} is deprecated and will be removed in the next release; "
                      f"import {self.new} instead", DeprecationWarning, stacklevel=2)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX):] in MOVED:
            return importlib.util.spec_from_loader(fullname, _Forward(MOVED[fullname[len(_PREFIX):]]))
        return None


_FINDER = _Finder()


def install() -> None:
    """Put the finder on sys.meta_path (once; importing distrain.comm calls this)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
