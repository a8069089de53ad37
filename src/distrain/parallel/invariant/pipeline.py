"""The layout-invariant step of a pipeline: its micro-batches are the units of work.

    grads = StageGradients(units, params, addends=U, group=dp_group, src=first rank of dp_group)
    step = InvariantPipelineStep(stage, loss_fn, grads, units=U, replica_units=range(d*m, d*m + m),
                                 seed=0, schedule="1f1b")
    loss = step(x, y, step_index)   # x on the first stage, y on the last; every rank gets the global loss

Replica d of D runs its m = U / D units as the m micro-batches of one pipeline step (``pipeline_step`` or
``interleaved_step`` with :class:`~distrain.parallel.pipeline_parallel.MicrobatchHooks`): each micro-batch's
loss unscaled, as one process's unit; the first stage seeds the generator by the unit's global index and the
later stages continue from the state the previous one passed on, so a unit draws what one process's forward
draws. Every op that leaves a micro-batch's gradients in ``.grad`` (a backward, an interleaved chunk's
backward, ZB-H1's B and its deferred W) hands them to :class:`StageGradients` at once (``.grad`` is None
again before the next op: no float addition ever joins two units), which converts them at the stage's
per-parameter exponents (a stage's parameters are its own, so per-stage exponents are the one process's).

The exponents come from global unit 0 as in gradients.py, with one difference: a schedule may run other
micro-batches' backwards before micro-batch 0's gradients are complete on a stage (GPipe runs its backwards
last to first, ZB-H1 may run B of micro-batch 1 before W of micro-batch 0, interleaved runs chunk v-1 of
micro-batches 0..p-1 before chunk 0), so gradients that arrive before the calibration wait, per micro-batch,
and are converted once it is done (GPipe: until the step's last backward, all m micro-batches' gradients).
A parameter whose unit-0 gradient is zero (or absent) is scaled by a rule of its own (a reference of 1.0:
fixed_point.scale_exponents), so no stage needs another's references.

The end of the step: one max over the stage's dp group of the largest converted value (gradients.py's
``finish``), then one max over the world of the units' losses (each has one contributor: the last stage of
the replica that ran it) and of the overflow flag, so every stage redoes the step, or none does; a redo
first measures every parameter's range over the step (one max over the dp group), then runs at exponents
from it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import TrainingError
from distrain.parallel.invariant.fixed_point import maxima, scale_exponents
from distrain.parallel.invariant.gradients import FixedPointGradients
from distrain.parallel.invariant.units import unit_seed
from distrain.parallel.pipeline_parallel import InterleavedStage, MicrobatchHooks, interleaved_step, pipeline_step


def _world_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(t, op="max", algorithm="native")
    return t


class StageGradients(FixedPointGradients):
    """FixedPointGradients of one pipeline stage (every parameter in ``params``: DDP, ZeRO 1-2 or one replica),
    fed by :meth:`take` after each op rather than through ``.grad`` views (ZB-H1's W writes ``.grad`` outside
    autograd); ``group``: the stage's dp group (None: one replica)."""

    def __init__(self, units, params, *, addends: int, group=None, src: int = 0):
        super().__init__(units, params, addends=addends, group=group, src=src, views=False)
        self._early: dict[int, list[tuple[int, torch.Tensor]]] = {}  # micro-batch -> (unit, flat) before calibration

    def begin(self, exponents: list[int] | None = None, measure: bool = False) -> None:
        super().begin(exponents, measure)
        self._early.clear()

    def take(self, k: int) -> None:
        """Micro-batch k's gradients now in ``.grad``: converted (or kept until they can be), ``.grad`` None."""
        for i, (u, ps) in enumerate(zip(self.units, self.params)):
            gs = [p.grad for p in ps]
            if all(g is None for g in gs):
                continue
            flat = u.flatten(gs, ps[0])  # (a parameter without a gradient here: zeros)
            for p in ps:
                p.grad = None
            if self.exponents is None and not self.measuring:
                self._early.setdefault(k, []).append((i, flat))
            else:
                self._add(i, flat)

    def calibrate(self) -> None:
        """Once this replica's first micro-batch (global unit 0 on the first replica) is complete: the
        exponents from the first replica's references (a broadcast over the dp group), then the waiting
        gradients."""
        local = torch.zeros(sum(self.counts), dtype=torch.float64)
        if self.group is None or dist.get_rank() == self.src:
            for i, flat in self._early.get(0, []):  # (one op's parameters each: disjoint, so max is the value)
                k = sum(self.counts[:i])
                local[k:k + self.counts[i]] = torch.maximum(local[k:k + self.counts[i]],
                                                            maxima(self.units[i].views(flat)))
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.broadcast(local, src=self.src, group=self.group, algorithm="native")
        self.exponents = scale_exponents(local.tolist(), self.addends)
        early, self._early = self._early, {}
        for gs in early.values():
            for i, flat in gs:
                self._add(i, flat)


class _Hooks(MicrobatchHooks):
    def __init__(self, step: "InvariantPipelineStep", losses: torch.Tensor, index: int):
        self.step, self.losses, self.index = step, losses, index

    def forward(self, k: int) -> None:
        s = self.step
        torch.manual_seed(unit_seed(s.seed, self.index, s.mine[k]))

    def loss(self, k: int, loss: torch.Tensor) -> None:
        self.losses[self.step.mine[k]] = float(loss.detach())

    def grads(self, k: int, complete: bool) -> None:
        g = self.step.grads
        g.take(k)
        if complete and k == 0 and g.exponents is None and not g.measuring:
            g.calibrate()


class InvariantPipelineStep:
    """One replica's pipeline stage ``stage`` (PipelineStage or InterleavedStage) running units
    ``replica_units`` of ``units`` as its micro-batches; ``loss_fn(output, target)`` on the last stage;
    ``quiet``: the data-parallel wrapper's no_sync; ``context``: around the whole pipeline step (autocast)."""

    def __init__(self, stage, loss_fn: Callable, grads: StageGradients, *, units: int, replica_units: range,
                 seed: int, schedule: str, context=contextlib.nullcontext, quiet=contextlib.nullcontext):
        self.stage, self.loss_fn, self.grads, self.schedule = stage, loss_fn, grads, schedule
        self.units, self.mine, self.seed = units, replica_units, seed
        self.context, self.quiet = context, quiet
        self.redone = 0

    def _run(self, x, y, hooks: _Hooks) -> None:
        s, m = self.stage, len(self.mine)
        x = x if s.is_first else None
        y = y if s.is_last else None
        fn = self.loss_fn if s.is_last else None
        with self.quiet(), self.context():
            if isinstance(s, InterleavedStage):
                interleaved_step(s, x, y, fn, num_microbatches=m, hooks=hooks)
            else:
                pipeline_step(s, x, y, fn, schedule=self.schedule, num_microbatches=m, hooks=hooks)

    def __call__(self, x, y, step: int) -> float:
        """The step's loss (float64 mean of the units' losses, the same on every rank); afterwards the
        stage's int64 sums wait in ``grads`` (``gradients()`` / ``shard_gradients()``)."""
        fits, losses = self._attempt(x, y, step)
        if not fits:  # some stage overflowed: every stage measures its range, then runs once more
            self.redone += 1
            self._attempt(x, y, step, measure=True)
            fits, losses = self._attempt(x, y, step, exponents=self.grads.measured())
            if not fits:
                raise TrainingError("InvariantPipelineStep: the step overflowed at exponents from its own maxima "
                                   "(a bug)")
        return math.fsum(losses[:-1].tolist()) / self.units

    def _attempt(self, x, y, step: int, exponents=None, measure: bool = False):
        """One pipeline step over this replica's units; (every stage's conversions fitted, [unit losses...,
        overflow]) after one max over the world: every stage redoes the step, or none does."""
        losses = torch.full((self.units + 1,), -math.inf, dtype=torch.float64)
        self.grads.begin(exponents, measure=measure)
        self._run(x, y, _Hooks(self, losses, step))
        if measure:
            return True, losses
        fits, _ = self.grads.finish(None)  # (the largest converted value over the stage's dp group)
        losses[-1] = 0.0 if fits else 1.0
        _world_max(losses)
        return bool(losses[-1] == 0.0), losses


__all__ = ["InvariantPipelineStep", "StageGradients"]
