"""Tensor-parallel plans: which module of a model becomes which Megatron layer.

A plan maps module names (``model.named_modules()``) to a *style*, as the plans of torch's
``parallelize_module`` do; the model itself knows nothing of parallelism, and the plan of a
model sits beside it (``distrain.models.gpt.plan``, ``distrain.models.mlp.plan``)::

    plan = TPPlan({"ff_in": "colwise", "ff_out": "rowwise", "out": ColwiseParallel(gather_output=True)})
    apply_tensor_parallel(model, topo.tp_group, "ring", plan=plan)

Styles (strings are the defaults of the classes)::

    "colwise"     nn.Linear -> ColumnParallelLinear: f on the input, output (..., O/P) sharded
    "rowwise"     nn.Linear -> RowParallelLinear: input (..., C/P) sharded, g on the output
    "vocab"       nn.Embedding -> VocabParallelEmbedding: rows of the vocabulary, g on the output
    "copy_input"  any module: f on its first input (a forward pre-hook), so several column-
                  parallel linears reading that input (q, k, v with sync_input=False) share one f

Sequence parallelism (:mod:`.sequence`): ``ColwiseParallel(sequence_parallel=True)`` and
``CopyInput(sequence_parallel=True)`` all-gather their input along the plan's ``sequence_dim``
in place of f, ``RowwiseParallel(sequence_parallel=True)`` reduce-scatters its output in place
of g, and two more styles mark the regions between them::

    "sequence_parallel"      any module run on sequence shards (LayerNorm, dropout): its
                             parameters' gradients are summed over the tp group
    "split_sequence_output"  any module whose replicated output enters the sharded region:
                             keep this rank's rows (a forward hook; backward all-gathers)

Name matching: a key matches a module whose name equals it, or ends with ``"." + key``, with
``fnmatch`` wildcards (``"mlp.fc"`` matches ``layers.3.mlp.fc``; ``"layers.*.attn"`` works too).
One module may match one key only. Keys that match nothing are allowed (a pipeline stage holds
some layers only), but a plan must match at least one module.

A plan whose output stays sharded along its last dimension names the ``loss`` that reads the
shards (the GPT's: vocab-parallel cross entropy, equal to ``lm_loss`` on the gathered logits);
``check(model, tp_size)`` lets a model name its own sizes in errors (whole attention heads;
every plan's check and the per-module one here are :func:`.sizes.check_tp_divides`).
Every check runs before any module changes or any collective runs.
"""

from __future__ import annotations

import fnmatch
import weakref
from dataclasses import dataclass, field
from typing import Callable, Mapping, NamedTuple, Union

import torch
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    TPModule,
    VocabParallelEmbedding,
    copy_to_tp,
)
from distrain.parallel.tensor_parallel.sequence import (
    RegatherSaved, gather_from_sequence, split_to_sequence, sync_grads_over_tp,
)
from distrain.parallel.tensor_parallel.invariant import chunk_input
from distrain.parallel.tensor_parallel.sizes import check_tp_divides

__all__ = ["ColwiseParallel", "CopyInput", "RowwiseParallel", "SequenceParallel", "ShardInfo", "SplitSequenceOutput",
           "TPPlan", "VocabParallel", "apply_tensor_parallel", "invariant_chunks", "tp_shard_info"]


@dataclass(frozen=True)
class ColwiseParallel:
    sync_input: bool = True          # False: the input already went through f (see CopyInput)
    gather_output: bool = False      # True: all-gather the (..., O/P) shards into (..., O)
    sequence_parallel: bool = False  # True: the input is a sequence shard, all-gathered in place of f


@dataclass(frozen=True)
class RowwiseParallel:
    input_is_parallel: bool = True   # False: the input is replicated; keep this rank's slice
    sequence_parallel: bool = False  # True: reduce-scatter the output along the sequence in place of g


@dataclass(frozen=True)
class VocabParallel:
    pass


@dataclass(frozen=True)
class CopyInput:
    sequence_parallel: bool = False  # True: all-gather the sequence shards in place of f


@dataclass(frozen=True)
class SequenceParallel:
    pass


@dataclass(frozen=True)
class SplitSequenceOutput:
    pass


Style = Union[ColwiseParallel, RowwiseParallel, VocabParallel, CopyInput, SequenceParallel, SplitSequenceOutput]
STYLE_NAMES: dict[str, Style] = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel(),
                                 "vocab": VocabParallel(), "copy_input": CopyInput(),
                                 "sequence_parallel": SequenceParallel(),
                                 "split_sequence_output": SplitSequenceOutput()}
_HOOK_STYLES = (CopyInput, SequenceParallel, SplitSequenceOutput)  # any module; nothing replaced
LossOnShards = Callable[[torch.Tensor, torch.Tensor, TPGroup], torch.Tensor]


@dataclass(frozen=True)
class TPPlan:
    """``layers``: {module name pattern: style or style name}; ``loss(output shard, target, tp)``
    for a plan whose output stays sharded (None: the output is replicated); ``check``: sizes;
    ``sequence_dim``: the sequence dimension of the activations (1 for (B, T, C))."""

    layers: Mapping[str, Union[str, Style]]
    loss: LossOnShards | None = None
    check: Callable[[nn.Module, int], None] | None = None
    sequence_dim: int = 1
    styles: dict[str, Style] = field(init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.layers, Mapping) or not self.layers:
            raise ConfigError(f"TPPlan: layers must be a non-empty mapping {{module name: style}}, got {self.layers!r}")
        styles = {}
        for key, style in self.layers.items():
            if isinstance(style, str):
                if style not in STYLE_NAMES:
                    raise ConfigError(f"TPPlan: {key!r} has unknown style {style!r}; use one of "
                                      f"{', '.join(STYLE_NAMES)} or a ColwiseParallel/RowwiseParallel object")
                style = STYLE_NAMES[style]
            if not isinstance(style, (ColwiseParallel, RowwiseParallel, VocabParallel) + _HOOK_STYLES):
                raise ConfigError(f"TPPlan: {key!r} maps to {style!r}, not a style")
            styles[key] = style
        object.__setattr__(self, "styles", styles)

    def match(self, name: str) -> list[str]:
        """The keys whose pattern matches module ``name``."""
        return [k for k in self.styles if fnmatch.fnmatchcase(name, k) or fnmatch.fnmatchcase(name, "*." + k)]


def as_plan(plan) -> TPPlan:
    if isinstance(plan, TPPlan):
        return plan
    if isinstance(plan, Mapping):
        return TPPlan(plan)
    raise ConfigError(f"tensor parallel: plan must be a TPPlan or a mapping {{module name: style}}, got "
                      f"{type(plan).__name__} (the GPT's is distrain.models.gpt.plan.gpt_tp_plan())")


# ---------------------------------------------------------------------------------------
# Applying a plan
# ---------------------------------------------------------------------------------------

_NEEDS = {ColwiseParallel: (nn.Linear, "out_features"), RowwiseParallel: (nn.Linear, "in_features"),
          VocabParallel: (nn.Embedding, "num_embeddings")}


def _check_module(name: str, m: nn.Module, style: Style, P: int) -> None:
    if isinstance(m, TPModule) or m in _HOOKED:
        raise ConfigError(f"apply_tensor_parallel: {name} is already tensor-parallel; apply a plan once, "
                          f"to a model built whole")
    if isinstance(style, _HOOK_STYLES):
        return
    cls, dim = _NEEDS[type(style)]
    if type(m) is not cls:
        raise ConfigError(f"apply_tensor_parallel: {name} is a {type(m).__name__}, but its style "
                          f"{type(style).__name__} needs an nn.{cls.__name__}")
    check_tp_divides(P, {f"{name}.{dim}": getattr(m, dim)}, f"module {name}")
    if isinstance(m, nn.Embedding) and (m.padding_idx is not None or m.max_norm is not None or m.sparse):
        raise ConfigError(f"apply_tensor_parallel: {name} has padding_idx, max_norm or sparse=True, which "
                          f"VocabParallelEmbedding does not support")


def _replicated(model: nn.Module) -> list[str]:
    """Names of the modules that declare ``tp_replicated = True``: under tensor parallelism every rank
    keeps them whole and runs them on the same (replicated) input, so the plan leaves them and all
    they contain alone (a mixture of experts: its experts' parallelism is expert parallelism)."""
    return [n for n, m in model.named_modules() if n and getattr(m, "tp_replicated", False)]


def _resolve(model: nn.Module, plan: TPPlan) -> list[tuple[str, nn.Module, Style]]:
    found = []
    whole = _replicated(model)
    if whole and any(isinstance(s, (SequenceParallel, SplitSequenceOutput)) for s in plan.styles.values()):
        raise ConfigError(f"apply_tensor_parallel: {whole[0]} is kept whole on every rank (tp_replicated), which "
                          f"needs the replicated activations of a plan without sequence parallelism; use "
                          f"sequence_parallel=False")
    for name, m in model.named_modules():
        if any(name == w or name.startswith(w + ".") for w in whole):
            continue
        keys = plan.match(name) if name else []
        if len(keys) > 1:
            raise ConfigError(f"apply_tensor_parallel: module {name} matches several plan keys {keys}; "
                              f"make the keys specific enough that each module matches one")
        if keys:
            found.append((name, m, plan.styles[keys[0]]))
    if not found:
        some = [n for n, _ in model.named_modules() if n][:8]
        raise ConfigError(f"apply_tensor_parallel: the plan's keys {list(plan.styles)} match no module of "
                          f"{type(model).__name__} (its modules are named like {some})")
    return found


class _InputHook:
    """Forward pre-hook: f on the module's first input, or the all-gather of its sequence shards;
    then, until the forward hook, what is saved from the gathered input is kept as the shard."""

    def __init__(self, tp: TPGroup, sequence_dim: int | None):
        self.tp, self.dim = tp, sequence_dim
        self.active: list = []

    def __call__(self, module, args):
        if self.tp.chunks and self.dim is None:  # --layout-invariant: one view per chunk (invariant.py)
            x = chunk_input(args[0], self.tp)[0]
            self.active.append(x)
            return (x,) + tuple(args[1:])
        if self.dim is None:
            return (copy_to_tp(args[0], self.tp),) + tuple(args[1:])
        full = gather_from_sequence(args[0], self.tp, dim=self.dim)          # (B, T/P, C) -> (B, T, C)
        hooks = RegatherSaved(full, args[0], self.tp, self.dim).hooks
        hooks.__enter__()
        self.active.append(hooks)
        return (full,) + tuple(args[1:])

    def done(self, module, args, out):
        if not self.active:
            return
        top = self.active.pop()
        if not isinstance(top, torch.Tensor):
            top.__exit__(None, None, None)
        elif torch.is_grad_enabled() and top.requires_grad and not top.tp_chunk_readers:
            raise ConfigError(f"--layout-invariant: {type(module).__name__} (CopyInput in the tensor-parallel plan) "
                              f"used its input without a column-parallel linear reading it as is, so its gradient "
                              f"sum cannot be ordered; this model's plan is not covered by --layout-invariant")


class _SplitOutputHook:
    """Forward hook: this rank's rows of the module's (replicated) output."""

    def __init__(self, tp: TPGroup, sequence_dim: int):
        self.tp, self.dim = tp, sequence_dim

    def __call__(self, module, args, out):
        return split_to_sequence(out, self.tp, dim=self.dim)


_HOOKED: weakref.WeakSet = weakref.WeakSet()  # the modules a hook style (CopyInput, ...) made tensor-parallel


def _hook(m: nn.Module, style: Style, tp: TPGroup, dim: int) -> None:
    if isinstance(style, CopyInput):
        hook = _InputHook(tp, dim if style.sequence_parallel else None)
        m.register_forward_pre_hook(hook)
        m.register_forward_hook(hook.done, always_call=True)
    elif isinstance(style, SplitSequenceOutput):
        m.register_forward_hook(_SplitOutputHook(tp, dim))
    else:
        sync_grads_over_tp(m, tp)
    _HOOKED.add(m)


def _replacement(m: nn.Module, style: Style, tp: TPGroup, dim: int) -> nn.Module:
    if isinstance(style, ColwiseParallel):
        return ColumnParallelLinear.from_linear(m, tp, sync_input=style.sync_input, gather_output=style.gather_output,
                                                sequence_parallel=style.sequence_parallel, seq_dim=dim)
    if isinstance(style, RowwiseParallel):
        return RowParallelLinear.from_linear(m, tp, input_is_parallel=style.input_is_parallel,
                                             sequence_parallel=style.sequence_parallel, seq_dim=dim)
    return VocabParallelEmbedding.from_embedding(m, tp)


def apply_tensor_parallel(model: nn.Module, group=None, algorithm: str = "native", *, plan) -> nn.Module:
    """Split ``model`` over the tp ``group`` in place, as ``plan`` says, and return it. Every rank
    passes the same full model (same seed) and the same plan; rank r keeps block r of P of each
    planned weight (copied from the full module: no random draw). Unplanned modules stay whole
    (replicated). Raises ConfigError, before changing anything, when a planned module has the
    wrong type or a size tp does not divide, or is already tensor-parallel.

    ``group`` may be a :class:`TPGroup` (its algorithm then rules); one with ``chunks``
    (``--layout-invariant``, ``TPGroup.alone(chunks=C)`` on one process) makes the layers compute the
    canonical chunked sums of :mod:`.invariant`, and every split size must divide by the chunks."""
    tp = group if isinstance(group, TPGroup) else TPGroup(group, algorithm)  # checks the algorithm and membership
    plan = as_plan(plan)
    found = _resolve(model, plan)
    split = tp.chunks or tp.size  # the chunks are a multiple of the tp size
    if plan.check is not None:
        plan.check(model, split)
    for name, m, style in found:
        _check_module(name, m, style, split)
    # Everything is valid: replace the modules on their parents, children before parents.
    for name, m, style in reversed(found):
        if isinstance(style, _HOOK_STYLES):
            _hook(m, style, tp, plan.sequence_dim)
            continue
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, _replacement(m, style, tp, plan.sequence_dim))
    return model


def invariant_chunks(model: nn.Module, plan, most: int) -> int:
    """The canonical chunk count C of ``--layout-invariant`` for ``model`` under ``plan``: the largest power
    of two up to ``most`` dividing every size the plan splits (a function of the model alone, so every
    layout of one run computes the same chunks; tp must divide it). Pure: nothing changes."""
    plan = as_plan(plan)
    found = _resolve(model, plan)
    c = most
    while c > 1:
        try:
            if plan.check is not None:
                plan.check(model, c)
            for name, m, style in found:
                _check_module(name, m, style, c)
            return c
        except ConfigError:
            c //= 2
    return 1


# ---------------------------------------------------------------------------------------
# Which slice each rank holds (for checkpoints)
# ---------------------------------------------------------------------------------------

class ShardInfo(NamedTuple):
    """Where a parameter of a tp rank sits in the full one. ``dim`` None: replicated."""
    dim: int | None
    start: int
    stop: int
    full_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        if tuple(full.shape) != tuple(self.full_shape):
            raise ConfigError(f"ShardInfo.take: full tensor has shape {tuple(full.shape)}, expected "
                              f"{tuple(self.full_shape)}")
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)


def tp_shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """{parameter name (as in ``model.named_parameters()``): ShardInfo} for every parameter.
    A checkpoint of a tp rank stores it next to the shards; ``info.take(full)`` slices a
    full tensor (from a single-process checkpoint) into this rank's shard."""
    sharded: dict[str, ShardInfo] = {}
    rank, size = 0, 1  # a model without tensor parallelism: everything is whole
    for mname, m in model.named_modules():
        if isinstance(m, TPModule):
            rank, size = m.tp_rank, m.tp_size
            for pname, (dim, a, b, shape) in m.shard_info().items():
                sharded[f"{mname}.{pname}" if mname else pname] = ShardInfo(dim, a, b, tuple(shape), rank, size)
    return {name: sharded.get(name) or ShardInfo(None, 0, p.shape[0] if p.dim() else 1, tuple(p.shape), rank, size)
            for name, p in model.named_parameters()}
