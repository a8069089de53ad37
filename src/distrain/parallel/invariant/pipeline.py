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
A parameter whose unit-0 gradient is zero (or absent) takes one process's fallback, the largest reference
over the WHOLE model, which only the end of the step knows (one max over the world): its gradients wait
until then.

The end of the step: one max over the world of the references' largest (the fallback), one max over the dp
group of every parameter's largest |gradient| (gradients.py's ``finish``), one max over the world of the
units' losses (each has one contributor: the last stage of the replica that ran it) and of the overflow flag,
so every stage redoes the step, or none does.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
import torch.distributed as dist

from distrain import comm
from distrain.parallel.invariant.fixed_point import scale_exponents
from distrain.parallel.invariant.gradients import FixedPointGradients
from distrain.parallel.invariant.units import unit_seed
from distrain.parallel.pipeline_parallel import InterleavedStage, MicrobatchHooks, interleaved_step, pipeline_step


def _abs_max(g: torch.Tensor) -> float:
    """max |g| (0.0 for an empty tensor, NaN if g holds one)."""
    if not g.numel():
        return 0.0
    lo, hi = torch.aminmax(g.detach())
    return float(torch.maximum(hi, -lo).to(torch.float64))


def _world_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        comm.all_reduce(t, op="max", algorithm="native")
    return t


class StageGradients(FixedPointGradients):
    """FixedPointGradients of one pipeline stage (every parameter in ``params``: DDP, ZeRO 1-2 or one replica),
    fed by :meth:`take` after each op rather than by autograd hooks (ZB-H1's W writes ``.grad`` outside
    autograd); ``group``: the stage's dp group (None: one replica)."""

    def __init__(self, units, params, *, addends: int, group=None, src: int = 0):
        super().__init__(units, params, addends=addends, group=group, src=src, hooks=False)
        self._flat = [p for ps in params for p in ps]
        self._early: dict[int, list[tuple[int, torch.Tensor]]] = {}  # micro-batch -> before the calibration
        self._late: list[tuple[int, torch.Tensor]] = []  # gradients of parameters waiting for the fallback
        self._deferred: set[int] = set()  # parameters whose unit-0 reference is zero (or not finite)
        self._top = 0.0  # the largest finite reference of this stage

    def begin(self, exponents: list[int] | None = None) -> None:
        super().begin(exponents)
        self._early.clear()
        self._late.clear()
        self._deferred = set()
        self._top = 0.0

    def take(self, k: int) -> None:
        """Micro-batch k's gradients now in ``.grad``: converted (or kept until they can be), ``.grad`` None."""
        for i, p in enumerate(self._flat):
            g = p.grad
            if g is None:
                continue
            p.grad = None
            if self.exponents is None:
                self._early.setdefault(k, []).append((i, g))
            elif i in self._deferred:
                self._late.append((i, g))
            else:
                self._add(i, g)

    def calibrate(self) -> None:
        """Once this replica's first micro-batch (global unit 0 on the first replica) is complete: the
        exponents from the first replica's references (a broadcast over the dp group), then the waiting
        gradients."""
        local = torch.zeros(len(self.slots), dtype=torch.float64)
        for i, g in self._early.get(0, []):
            local[i] = _abs_max(g)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.broadcast(local, src=self.src, group=self.group, algorithm="native")
        ref = local.tolist()
        self._deferred = {i for i, m in enumerate(ref) if not (m > 0 and math.isfinite(m))}
        self._top = max([m for m in ref if math.isfinite(m)] + [0.0])
        self.exponents = scale_exponents(ref, self.addends)  # the deferred ones' are set in settle()
        early, self._early = self._early, {}
        for gs in early.values():
            for i, g in gs:
                if i in self._deferred:
                    self._late.append((i, g))
                else:
                    self._add(i, g)

    def local_maxima(self) -> torch.Tensor:
        """Every parameter's largest |gradient| over this replica's units so far, (parameters,) float64."""
        m = self.maxima
        if torch.is_tensor(m):
            return m.clone()
        zero = torch.zeros((), dtype=torch.float64)  # (kept per parameter as 0-d tensors, None before any)
        return torch.stack([zero if t is None else t.to(torch.float64) for t in m]) if m else zero.view(0)

    def settle(self) -> None:
        """End of a calibrated attempt (collective over the world): the fallback exponent from the whole
        model's largest reference, and the gradients that waited for it."""
        top = float(_world_max(torch.tensor([self._top], dtype=torch.float64))[0])
        fallback = scale_exponents([0.0, top], self.addends)[0]
        for i in self._deferred:
            self.exponents[i] = fallback
        for i, g in self._late:
            self._add(i, g)
        self._late.clear()


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
        if complete and k == 0 and g.exponents is None:
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
        exponents = None
        for _attempt in range(2):
            losses = torch.full((self.units + 1,), -math.inf, dtype=torch.float64)  # [unit losses..., overflow]
            self.grads.begin(exponents)
            self._run(x, y, _Hooks(self, losses, step))
            if exponents is None:
                self.grads.settle()
            redo, maxima = self.grads.finish(self.grads.local_maxima())  # (maxima: over the dp group)
            losses[-1] = 0.0 if redo is None else 1.0
            _world_max(losses)
            if losses[-1] == 0.0:
                return math.fsum(losses[:-1].tolist()) / self.units
            # some stage overflowed: every stage runs again, at exponents from its step's maxima (one process's
            # redo: every parameter's, whether or not its own conversions fitted)
            exponents = scale_exponents(maxima.tolist(), self.grads.addends)
            self.redone += 1
        raise RuntimeError("InvariantPipelineStep: the step overflowed twice (a bug: the redo's exponents come "
                           "from its maxima)")


__all__ = ["InvariantPipelineStep", "StageGradients"]
