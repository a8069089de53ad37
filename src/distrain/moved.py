"""Old module paths, kept importable for one release: one table, MOVED, {old path: new path}.

Every module that moved in a redesign is one entry of MOVED (comm/ split into core/,
algorithms/, shm/; parallel/ into one folder per paradigm; models/ into one folder per model
with its plan beside it; bench/ into one folder per tool, where a document names the old
path; the trainer's checkpoint modules into distrain.checkpoint). ``import distrain`` puts a finder on ``sys.meta_path``, and any ``import
distrain.x.y`` imports the package first, so every old path imports: the finder
answers for it with a thin module that forwards every attribute to the new module and warns
once, on import (DeprecationWarning naming the new path, pointing at the importing line).
Importing an old child of an old package (``distrain.models.hf.plan``) warns for the child
only, not for the parent Python imports on the way.

A name that left a moved module for another place is an entry of MOVED_NAMES ({old path of
the name: where it went}); reading it raises AttributeError saying where. Nothing lives at an
old path (no file, no folder: tests/test_module_paths.py checks), so nothing but this finder
answers for one. Setting an attribute on an old module does not reach the new one: patch the
new path. This module imports the standard library only: the new modules are imported
through importlib when an old path is.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

MOVED: dict[str, str] = {
    # comm/: the flat modules before core/, algorithms/ and shm/ (the docs and the 0.x API named these)
    "distrain.comm.util": "distrain.comm.core.util",
    "distrain.comm.tags": "distrain.comm.core.tags",
    "distrain.comm.ops": "distrain.comm.core.ops",
    "distrain.comm.group": "distrain.comm.core.group",
    "distrain.comm.torchargs": "distrain.comm.core.torchargs",
    "distrain.comm.p2p": "distrain.comm.core.p2p",
    "distrain.comm.ledger": "distrain.comm.core.ledger",
    "distrain.comm.watchdog": "distrain.comm.core.watchdog",
    "distrain.comm.registry": "distrain.comm.core.registry",
    "distrain.comm.transports": "distrain.comm.core.transport",
    "distrain.comm.transport": "distrain.comm.core.transport",
    "distrain.comm.star": "distrain.comm.algorithms.star",
    "distrain.comm.ring": "distrain.comm.algorithms.ring",
    "distrain.comm.tree": "distrain.comm.algorithms.tree",
    "distrain.comm.cost": "distrain.comm.algorithms.cost",
    "distrain.comm.shm_segment": "distrain.comm.shm.segment",
    "distrain.comm.shm_p2p": "distrain.comm.shm.p2p",
    "distrain.comm.shm_coll": "distrain.comm.shm.collectives",
    "distrain.comm.hierarchy": "distrain.comm.shm.hierarchy",
    # parallel/: one folder per paradigm (the flat modules before)
    "distrain.parallel.ddp": "distrain.parallel.data_parallel.ddp",
    "distrain.parallel.ps": "distrain.parallel.parameter_server",
    "distrain.parallel.ps_layout": "distrain.parallel.parameter_server.ps_layout",
    "distrain.parallel.pipeline": "distrain.parallel.pipeline_parallel",
    "distrain.parallel.pipeline_schedule": "distrain.parallel.pipeline_parallel.schedule",
    "distrain.parallel.pipeline_timeline": "distrain.parallel.pipeline_parallel.timeline",
    "distrain.parallel.tensor": "distrain.parallel.tensor_parallel",
    "distrain.parallel.tensor_layers": "distrain.parallel.tensor_parallel",
    # models/: one folder per model, its parallel plan beside it; Hugging Face transformers models by that name
    "distrain.models.gpt_plan": "distrain.models.gpt.plan",
    "distrain.models.mlp_plan": "distrain.models.mlp.plan",
    "distrain.models.hf": "distrain.models.hf_transformers",
    "distrain.models.hf.checks": "distrain.models.hf_transformers.checks",
    "distrain.models.hf.pipeline": "distrain.models.hf_transformers.pipeline",
    "distrain.models.hf.plan": "distrain.models.hf_transformers.plan",
    "distrain.models.hf.sizes": "distrain.models.hf_transformers.sizes",
    # trainer/: checkpoint code in one package of its own (distrain.checkpoint), the trainer calls it
    "distrain.trainer.checkpoint": "distrain.checkpoint.store",
    "distrain.trainer.reshard": "distrain.checkpoint.reshard",
    "distrain.trainer.checkpoint_read": "distrain.checkpoint.read",
    "distrain.trainer.checkpoint_models": "distrain.checkpoint.models",
    "distrain.trainer.checkpoint_import": "distrain.checkpoint.write",
    "distrain.trainer.hf_io": "distrain.checkpoint.hf",
    "distrain.trainer.init_from": "distrain.checkpoint.init_from",
    "distrain.trainer.data_vocab": "distrain.data.vocab",
    # bench/: one folder per tool (the flat modules before); only the ones a document still names
    "distrain.bench.pipeline_bench": "distrain.bench.pipeline.bubbles",
}

# names that left a moved module for another place: {old module path + "." + name: where it went}
MOVED_NAMES: dict[str, str] = {
    "distrain.parallel.tensor.check_tp_sizes": "distrain.models.gpt.plan",
    "distrain.parallel.tensor.tp_all_reduces_per_step": "distrain.models.gpt.plan",
    "distrain.parallel.pipeline.measure_bubbles": "distrain.bench.pipeline.bubbles",
    "distrain.parallel.pipeline.format_bubble_table": "distrain.bench.pipeline.bubbles",
    "distrain.parallel.pipeline_timeline.SyntheticLayer": "distrain.bench.pipeline.bubbles",
    "distrain.parallel.pipeline_timeline.measure_bubbles": "distrain.bench.pipeline.bubbles",
    "distrain.parallel.pipeline_timeline.format_bubble_table": "distrain.bench.pipeline.bubbles",
    "distrain.parallel.pipeline_timeline.main": "the command `distrain bench pipeline`",
    # the one tensor-parallel size check (tp, {name: size}, what) of every plan
    "distrain.models.hf.check_tp_sizes": "distrain.parallel.tensor_parallel.check_tp_divides",
    "distrain.models.hf.checks.check_tp_sizes": "distrain.parallel.tensor_parallel.check_tp_divides",
    "distrain.models.hf.sizes.check_tp_sizes": "distrain.parallel.tensor_parallel.check_tp_divides",
}


def _public_names(target: types.ModuleType) -> list[str]:
    return list(getattr(target, "__all__", None) or
                [n for n in vars(target) if not n.startswith("_")
                 and not isinstance(getattr(target, n), types.ModuleType)])


class _Forward(importlib.abc.Loader):
    """Makes the module at an old path: every attribute is the new module's, read on access."""

    def __init__(self, new: str):
        self.new = new

    def create_module(self, spec):
        old, target = spec.name, importlib.import_module(self.new)
        mod = types.ModuleType(old, f"Moved to {self.new}.")

        def __getattr__(name: str):  # PEP 562: called for the names the module itself lacks
            if f"{old}.{name}" in MOVED_NAMES:
                raise AttributeError(f"{old}.{name} moved to {MOVED_NAMES[f'{old}.{name}']}")
            if not (name.startswith("__") and name.endswith("__")):  # its own __path__, __spec__: not the new one's
                try:
                    return getattr(target, name)
                except AttributeError:
                    pass
            raise AttributeError(f"module {old!r} has no attribute {name!r}")

        mod.__getattr__ = __getattr__
        mod.__dir__ = lambda: dir(target)
        mod.__all__ = _public_names(target)
        return mod

    def exec_module(self, module) -> None:
        if _on_the_way_to_a_moved_child(module.__name__):
            return  # the child warns, naming its own new path
        # stacklevel 2 is the importing line: the warnings module skips importlib's own frames
        warnings.warn(f"{module.__name__} is deprecated and will be removed in the next release; "
                      f"import {self.new} instead", DeprecationWarning, stacklevel=2)


def _on_the_way_to_a_moved_child(name: str) -> bool:
    """Whether Python imports old path ``name`` as the parent of an old path it was asked for
    (``import distrain.models.hf.plan`` imports ``distrain.models.hf`` first): the import
    system's frames between here and the importing code say which module was asked for."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
        asked = frame.f_locals.get("name") if frame.f_code.co_name == "_find_and_load_unlocked" else None
        if isinstance(asked, str) and asked.startswith(name + ".") and asked in MOVED:
            return True
        frame = frame.f_back
    return False


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for the old paths of MOVED only (it sits last on sys.meta_path: nothing else
    finds them, since no file lives at an old path)."""

    def find_spec(self, fullname, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        new_spec = importlib.util.find_spec(new)
        is_package = new_spec is not None and new_spec.submodule_search_locations is not None
        # an old package's __path__ is empty: its old children are this finder's too, never files
        return importlib.util.spec_from_loader(fullname, _Forward(new), is_package=is_package)


_FINDER = _Finder()


def install() -> None:
    """Put the finder on sys.meta_path, once (``import distrain`` calls this)."""
    if _FINDER not in sys.meta_path:
        sys.meta_path.append(_FINDER)
