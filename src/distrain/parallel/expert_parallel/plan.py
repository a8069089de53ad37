"""Expert-parallel plans: which modules of a model are mixtures of experts, and how their experts split.

A mixture-of-experts layer that can run expert-parallel has (``distrain.models.moe.MoEFeedForward``
does; the contract, not the class, is what this reads):

    experts       an ``nn.ModuleDict`` keyed by the expert's global id ("0" .. "E-1")
    num_experts   E
    dispatch      where the experts run (``distrain.models.experts.ALL_HERE`` by default)

A plan names those layers, as a context-parallel plan names its attentions, and sits beside the
model (``models/llama/plan.py`` ``llama_ep_plan``)::

    plan = EPPlan(modules=("feed_forward",))
    apply_expert_parallel(model, ExpertParallel(topo.ep_group, topo.dp_cp_group), plan=plan)

Applying it keeps, in every named layer, the experts of this rank (ids [r*E/ep, (r+1)*E/ep), under
their global keys, so state-dict names stay the whole model's), records their parameters as the
experts' (:func:`expert_parameter_names` names them) and sets the layer's ``dispatch``. Name matching is
:class:`~distrain.parallel.tensor_parallel.TPPlan`'s (a name equal to the key or ending in
``"." + key``, ``fnmatch`` wildcards). Every check runs before any module changes.

Gradients (:func:`reduce_expert_gradients`): an expert's parameters on rank r hold the gradient of
every loss of its ep group whose tokens reached it, sum_{s in ep group} dL_s/dW; the D = dp x cp
ranks of the step each hold a loss that is its tokens' mean, and the step's gradient is
(1/D) sum_s dL_s/dW over all of them. The ranks holding the same experts (Topology's ``edp``
group, D/ep of them) together cover every s once, so the expert gradient is their sum divided by
D -- not their average (torchtitan sets FSDP's gradient divide factor to the dp size for the same
reason). The other parameters are DDP's, averaged over dp x cp as always.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.expert_parallel.dispatch import ExpertParallel

__all__ = ["EPPlan", "apply_expert_parallel", "expert_parameter_names", "reduce_expert_gradients",
           "sum_router_counts"]

# The parameters of the experts apply_expert_parallel kept on this rank (by identity; an entry goes with its parameter)
_EXPERT_PARAMETERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


@dataclass(frozen=True)
class EPPlan:
    """``modules``: name patterns of the mixture layers; ``check(model, ep)``: the model's own rules."""

    modules: Sequence[str]
    check: Callable[[nn.Module, int], None] | None = None

    def __post_init__(self):
        if isinstance(self.modules, str) or not self.modules or not all(isinstance(m, str) for m in self.modules):
            raise ConfigError(f"EPPlan: modules must be a non-empty sequence of module name patterns, got "
                              f"{self.modules!r}")

    def match(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, k) or fnmatch.fnmatchcase(name, "*." + k) for k in self.modules)

    def layers(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """The mixture layers of ``model`` the plan names (modules with a ModuleDict of experts)."""
        return [(n, m) for n, m in model.named_modules()
                if n and self.match(n) and isinstance(getattr(m, "experts", None), nn.ModuleDict)]


def apply_expert_parallel(model: nn.Module, ep: ExpertParallel, *, plan: EPPlan) -> nn.Module:
    """Keep this rank's experts in every mixture layer ``plan`` names and route through ``ep``, in
    place; returns the model. Raises ConfigError, before changing anything, when the plan names no
    mixture layer, a layer's experts are already split, or ep does not divide the experts."""
    if not isinstance(plan, EPPlan):
        raise ConfigError(f"apply_expert_parallel: plan must be an EPPlan, got {type(plan).__name__} (the Llama's is "
                          f"distrain.models.llama.plan.llama_ep_plan())")
    found = plan.layers(model)
    if not found:
        raise ConfigError(f"apply_expert_parallel: the plan's modules {list(plan.modules)} match no mixture-of-experts "
                          f"layer of {type(model).__name__} (a module with an nn.ModuleDict `experts`, `num_experts` "
                          f"and `dispatch`); --ep needs a model with experts, e.g. --model llama-moe-tiny")
    for name, m in found:
        if isinstance(m.dispatch, ExpertParallel) or len(m.experts) != m.num_experts:
            raise ConfigError(f"apply_expert_parallel: {name} is already expert-parallel; apply a plan once")
        ep.local_ids(m.num_experts)  # ep divides E, or the one-line error with the values that do
    if plan.check is not None:
        plan.check(model, ep.size)
    ep.num_experts = found[0][1].num_experts
    for _, m in found:
        if m.num_experts != ep.num_experts:
            raise ConfigError(f"apply_expert_parallel: the mixture layers have {m.num_experts} and {ep.num_experts} "
                              f"experts; one ExpertParallel splits one expert count")
    for _, m in found:
        m.experts = nn.ModuleDict({str(e): m.experts[str(e)] for e in ep.local_ids(m.num_experts)})
        for p in m.experts.parameters():
            _EXPERT_PARAMETERS[p] = True
        m.dispatch = ep
    return model


def expert_parameter_names(module: nn.Module) -> list[str]:
    """Names of the parameters an expert-parallel plan split (each rank holds its own experts')."""
    return [n for n, p in module.named_parameters() if p in _EXPERT_PARAMETERS]


@torch.no_grad()
def reduce_expert_gradients(params: list[torch.Tensor], group, tokens: int) -> None:
    """Expert gradients: summed over ``group`` (the ranks holding the same experts) and divided by
    ``tokens`` (the dp x cp ranks of the step; module docstring), in one flat all-reduce. A
    parameter without a gradient counts as zeros (and gets them), so every rank sends alike."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if group is not None and dist.get_world_size(group) > 1:
        comm.all_reduce(flat, op="sum", group=group, algorithm="native")
    flat.div_(tokens)
    for p, piece in zip(params, flat.split([p.numel() for p in params])):
        p.grad = piece.view_as(p).clone()


def sum_router_counts(model: nn.Module, plan: EPPlan | None, group) -> bool:
    """A mixture of experts trained by data ranks that each hold every expert (ep 1): route through an
    ``ExpertParallel`` that only sums the router's counts over ``group`` (the ranks that read the step's
    tokens), so the load-balancing loss is the global batch's, as one process's. ``parallelize`` does
    this for the dp x cp group (its step 2b); engines outside the grid (torch's DDP, the parameter
    server's workers) call it. Returns whether the model has mixture layers (False: left as it is)."""
    if plan is None or not plan.layers(model):
        return False
    apply_expert_parallel(model, ExpertParallel(None, group), plan=plan)
    return True
