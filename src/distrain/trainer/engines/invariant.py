"""``--layout-invariant`` inside the engines: one process, DDP and ZeRO 1-3 run the same units of work and
sum them the same way (distrain.parallel.invariant; docs/determinism.md).

``InvariantTraining.step(x, y, step)`` replaces an engine's forward/backward/sync/clip: this replica's units
one at a time, the int64 sums over the replicas, back to ``.grad`` (replicas) or to ZeRO's shard grads,
then the exact-norm clip. The engine then commits and steps its optimizer as usual.

With a pipeline (``stage``: this rank's PipelineStage or InterleavedStage) the replica's units are its
micro-batches (distrain.parallel.invariant.pipeline): each stage sums its own parameters' gradients over its
dp group, every rank gets the step's loss, and the clip's norm sums each element once over the world (the
stages over the pp group; ZeRO's shards over every rank).
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

from distrain import comm
from distrain.parallel.invariant import (
    FixedPointGradients, InvariantPipelineStep, InvariantStep, StageGradients, clip_exact, replica_units,
)
from distrain.errors import ConfigError
from distrain.parallel.zero.layout import make_unit
from distrain.trainer.checks.invariant import units_of


def invariant_tp_plan(cfg, model):
    """(the model's tensor-parallel plan, its canonical chunk count C) for a --layout-invariant run, or
    (None, None) for a model without a plan. Every layout applies the plan, one process too (tp = 1), so
    every layout computes the same chunked sums (distrain.parallel.tensor_parallel.invariant); C is the
    largest power of two up to INVARIANT_CHUNKS dividing every split size (a function of the model alone),
    and --tp must divide it."""
    from distrain.models.registry import model_tp_plan
    from distrain.parallel.tensor_parallel.invariant import INVARIANT_CHUNKS
    from distrain.parallel.tensor_parallel.plan import invariant_chunks

    plan = model_tp_plan(model)
    if plan is None:
        return None, None
    chunks = invariant_chunks(model, plan, INVARIANT_CHUNKS)
    if chunks % cfg.tp:
        raise ConfigError(f"--layout-invariant --tp {cfg.tp}: this model's split sizes allow {chunks} canonical chunk"
                          f"{'s' if chunks > 1 else ''}, which tp must divide; use --tp "
                          f"{' or '.join(str(d) for d in (1, 2, 4) if chunks % d == 0)}")
    return plan, chunks


def apply_invariant_tp(cfg, model):
    """One process (--strategy single, a parameter-server worker): the model's plan applied on a group of
    this process alone with the canonical chunks; returns the loss to train with (the plan's own on its
    output, else None: the model's)."""
    from distrain.parallel.tensor_parallel import apply_tensor_parallel
    from distrain.parallel.tensor_parallel.group import TPGroup

    plan, chunks = invariant_tp_plan(cfg, model)
    if plan is None:
        return None
    tp = TPGroup.alone(chunks=chunks)
    apply_tensor_parallel(model, tp, plan=plan)
    return None if plan.loss is None else (lambda output, target: plan.loss(output, target, tp))


class InvariantTraining:
    """Over ``module`` (whole on every replica, or ZeRO's ``zero`` around it; ``ddp``: the DDP wrapper whose
    own hooks stay quiet), replica ``replica`` of ``replicas`` over ``group`` (None: one process); ``stage``:
    the pipeline stage that ``module`` is, ``pp_group`` its pipeline's group (None: no pipeline).
    Tensor parallelism (``tp_group`` of more than one rank, ``tp_info``: the module's ShardInfo per
    parameter): each rank sums its shards' gradients over its replicas; exponents come from whole
    parameters, and the clip's norm counts a sharded parameter's shards once each and a replicated one
    on tp rank 0 only (its gradient is the same on every tp rank: the canonical sums make it so).
    ``units``/``first_unit`` (a DiLoCo island: its part of the global batch): the units ``group`` shares and
    the global index of the first (None: every unit of the batch, from 0)."""

    def __init__(self, cfg, module, loss_fn, *, replicas: int, replica: int, group=None, zero=None, ddp=None,
                 forward_context=contextlib.nullcontext, stage=None, pp_group=None, tp_group=None, tp_info=None,
                 units: int | None = None, first_unit: int = 0):
        torch.set_num_threads(1)  # a kernel's reduction order may depend on its thread count
        self.cfg, self.zero = cfg, zero
        self.units = units_of(cfg) if units is None else units
        self.group = group if (group is not None and dist.get_world_size(group) > 1) else None
        src = dist.get_process_group_ranks(group)[0] if self.group is not None else 0
        quiet = contextlib.nullcontext
        if zero is not None:
            units, params = zero.units, (None if zero.stage == 3 else zero.impl.params)
            if zero.stage < 3:
                quiet = zero.no_sync
        else:
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            units, params = [make_unit(0, named, 1)], [[p for _, p in named]]
            if ddp is not None:
                quiet = ddp.no_sync
        mine = replica_units(self.units, replicas, replica)
        self.numel = sum(u.numel for u in units)  # the whole model's elements: the norm's headroom
        self.pp_group = pp_group if (stage is not None and pp_group is not None) else None
        if stage is not None:
            self.grads = StageGradients(units, params, addends=self.units, group=self.group, src=src)
            if self.pp_group is not None:  # the stages' elements: the whole model's
                n = torch.tensor([self.numel], dtype=torch.int64)
                comm.all_reduce(n, op="sum", group=self.pp_group, algorithm="native")
                self.numel = int(n[0])
            self.run = InvariantPipelineStep(stage, loss_fn, self.grads, units=self.units, replica_units=mine,
                                             seed=cfg.seed, schedule=cfg.schedule, context=forward_context,
                                             quiet=quiet)
        else:
            self.grads = FixedPointGradients(units, params, addends=self.units, group=self.group, src=src,
                                             tp_group=tp_group)
            if zero is not None and zero.stage == 3:
                zero.impl.grad_sink = self.grads.take_flat
            self.run = InvariantStep(module, loss_fn, self.grads, units=self.units, replica_units=mine,
                                     seed=cfg.seed, forward_context=forward_context, quiet=quiet, first=first_unit)
        self.params = params
        self.tp_group = self.grads.tp_group
        self.counted = None  # tp: the gradients this rank adds to the norm (its shards; replicated: tp rank 0)
        if self.tp_group is not None:
            named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
            self.numel = sum(math.prod(tp_info[n].full_shape) for n, _ in named)
            first = dist.get_rank(self.tp_group) == 0
            self.counted = [p for n, p in named if tp_info[n].dim is not None or first]

    @property
    def samples_per_unit(self) -> int:
        return self.cfg.batch_size // units_of(self.cfg)

    @property
    def samples(self) -> slice:
        """This replica's samples of the part its group shares (a DiLoCo island's: every rank reads the island's
        part whole): its units' (``replica_units``), samples_per_unit each."""
        mine, n = self.run.mine, self.samples_per_unit
        return slice(mine.start * n, mine.stop * n)

    def _all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        comm.all_reduce(t, op=op, group=self.group, algorithm="native")
        return t

    def _world_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        comm.all_reduce(t, op=op, algorithm="native")
        return t

    def _tp_all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        comm.all_reduce(t, op=op, group=self.tp_group, algorithm="native")
        return t

    def _pp_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        comm.all_reduce(t, op=op, group=self.pp_group, algorithm="native")
        return t

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
        """Forward/backward of this replica's units, gradients summed, clipped: the step's loss (float64,
        the same on every rank)."""
        z = self.zero
        if z is not None:
            z.zero_grad()
        else:
            for ps in self.params:
                for p in ps:
                    p.grad = None
        loss = self.run(x, y, step)
        if z is not None:
            shards = z.parameters()
            rank = dist.get_rank(self.group) if self.group is not None else 0
            world = dist.get_world_size(self.group) if self.group is not None else 1
            for s, g in zip(shards, self.grads.shard_gradients(rank, world, [s.dtype for s in shards])):
                s.grad = g
            grads = [s.grad for s in shards]
            # every rank holds its own shard of its own stage: each element once over the world
            reduce = self._world_reduce if self.pp_group is not None else (
                self._all_reduce if self.group is not None else None)
        else:
            self.grads.gradients()
            grads = [p.grad for ps in self.params for p in ps]
            # replicas hold every element of their stage: the stages' sums over the pp group; each tp rank its
            # shards (and on tp rank 0 the replicated parameters): the sum over the tp group
            reduce = self._pp_reduce if self.pp_group is not None else (
                self._tp_all_reduce if self.tp_group is not None else None)
        if self.cfg.grad_clip:
            clip_exact(grads, self.cfg.grad_clip, addends=self.numel, all_reduce=reduce, counted=self.counted)
        return torch.tensor(loss, dtype=torch.float64)


__all__ = ["InvariantTraining"]
