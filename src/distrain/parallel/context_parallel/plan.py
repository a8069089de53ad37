"""Context-parallel plans: which modules of a model read the sequence layout, and the checks.

A model that splits along the sequence gives the modules that need to know it a ``sequence``
attribute (the modules that compute positions, and the attentions; the one-process default is
``distrain.models.sequence.WHOLE``). A plan names them, as a tensor-parallel plan names its
linears, and sits beside the model (``models/gpt/plan.py`` ``gpt_cp_plan``,
``models/llama/plan.py`` ``llama_cp_plan``)::

    plan = CPPlan(modules=("layers.0", "attn"), check=check_gpt_cp)
    apply_context_parallel(model, topo.cp_group, "ring", plan=plan)     # in place

Name matching is :class:`~distrain.parallel.tensor_parallel.TPPlan`'s: a key matches a module
whose name equals it or ends with ``"." + key``, ``fnmatch`` wildcards allowed. ``check(model, cp,
variant, tp=1)`` names the model's sizes in errors (whole heads for the all-to-all; no attention
dropout); ``tp`` > 1 (the trainer's check before start, on the whole model) says that tensor
parallelism will still divide the heads the modules hold now; ``input_dim``/``target_dim``: the
sequence dimension of the batch's inputs and targets, which :func:`~distrain.parallel.parallelize`
cuts with :meth:`ContextParallel.split`. Every check runs before any module changes or any
message is sent.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.nn as nn

from distrain.errors import ConfigError
from distrain.parallel.context_parallel.attention import ContextParallel, check_variant
from distrain.parallel.context_parallel.sizes import check_cp_heads

__all__ = ["CPPlan", "apply_context_parallel", "check_cp_heads"]  # (check_cp_heads: from sizes.py)


@dataclass(frozen=True)
class CPPlan:
    """``modules``: name patterns of the modules whose ``sequence`` the plan replaces; ``check(model,
    cp, variant)``: the model's own size errors; the batch's sequence dims."""

    modules: Sequence[str]
    check: Callable[[nn.Module, int, str], None] | None = None
    input_dim: int = 1
    target_dim: int = 1

    def __post_init__(self):
        if isinstance(self.modules, str) or not self.modules or not all(isinstance(m, str) for m in self.modules):
            raise ConfigError(f"CPPlan: modules must be a non-empty sequence of module name patterns, got "
                              f"{self.modules!r}")

    def match(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, k) or fnmatch.fnmatchcase(name, "*." + k) for k in self.modules)


def _resolve(model: nn.Module, plan: CPPlan) -> list[tuple[str, nn.Module]]:
    found = [(n, m) for n, m in model.named_modules() if n and plan.match(n)]
    if not found:
        some = [n for n, _ in model.named_modules() if n][:8]
        raise ConfigError(f"apply_context_parallel: the plan's modules {list(plan.modules)} match no module of "
                          f"{type(model).__name__} (its modules are named like {some})")
    for name, m in found:
        seq = getattr(m, "sequence", None)
        if seq is None:
            raise ConfigError(f"apply_context_parallel: {name} ({type(m).__name__}) has no `sequence` attribute, so it "
                              f"would not read the split layout; name only modules that compute positions or "
                              f"attention through `self.sequence` (see distrain.models.sequence)")
        if isinstance(seq, ContextParallel):
            raise ConfigError(f"apply_context_parallel: {name} is already context-parallel; apply a plan once")
    return found


def apply_context_parallel(model: nn.Module, group=None, variant: str = "ring", *, plan: CPPlan) -> nn.Module:
    """Give the modules ``plan`` names this rank's :class:`ContextParallel` (on ``group``, or an
    existing ContextParallel) as their ``sequence``, in place, and return the model. Raises
    ConfigError, before changing anything, for a plan that matches nothing or a module that reads
    no ``sequence``, and for the model's own rules (``plan.check``)."""
    if not isinstance(plan, CPPlan):
        raise ConfigError(f"apply_context_parallel: plan must be a CPPlan, got {type(plan).__name__} (the GPT's is "
                          f"distrain.models.gpt.plan.gpt_cp_plan())")
    cp = group if isinstance(group, ContextParallel) else ContextParallel(group, check_variant(variant))
    found = _resolve(model, plan)
    if plan.check is not None:
        plan.check(model, cp.size, cp.variant)
    for _, m in found:
        m.sequence = cp
    return model
