"""``InvariantStep``: one training step whose loss, gradients and update have the same bits in every layout.

    step = InvariantStep(module, loss_fn, grads, units=8, replica_units=range(0, 4), seed=0)
    loss = step(x, y, step_index)      # x: this replica's units, (4 * B/8, ...)
    # now every parameter's .grad (or ZeRO's shard grads) holds the global mean gradient

``units`` are the step's units over ``grads``' group (a DiLoCo island's: its part of the global batch, whose
unit 0 is global unit ``first``: a unit's random numbers follow its global index).

Each unit runs alone (``units.py``); its gradient goes into int64 accumulators (``gradients.py``); the
step's loss is the float64 mean of the units' losses, summed exactly (``math.fsum``) in unit order after
one all-reduce in which every unit's loss has exactly one contributor. The caller then reduces the
integers over its ranks (``FixedPointGradients.gradients`` or ``shard_gradients``), may clip with
:func:`clip_exact`, and steps its optimizer (elementwise, so a parameter's update does not depend on which
tensor holds it: checked by the layout tests).
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch

from distrain.errors import ConfigError, TrainingError
from distrain.parallel.invariant.fixed_point import exact_sum
from distrain.parallel.invariant.gradients import FixedPointGradients
from distrain.parallel.invariant.units import unit_seed


class InvariantStep:
    def __init__(self, module: Callable, loss_fn: Callable, grads: FixedPointGradients, *, units: int,
                 replica_units: range, seed: int, forward_context=contextlib.nullcontext,
                 quiet=contextlib.nullcontext, first: int = 0):
        self.module, self.loss_fn, self.grads = module, loss_fn, grads
        self.units, self.mine, self.seed = units, replica_units, seed
        self.first = first  # the global index of unit 0 here (a DiLoCo island's units: the island's first)
        self.forward_context, self.quiet = forward_context, quiet
        self.redone = 0  # steps redone (a gradient past the headroom: measured, then run again)

    def __call__(self, x: torch.Tensor, y: torch.Tensor, step: int) -> float:
        n = len(self.mine)
        if x.shape[0] % n or y.shape[0] != x.shape[0]:
            raise ConfigError(f"InvariantStep: {x.shape[0]} samples cannot be this replica's {n} units")
        xs, ys = x.chunk(n), y.chunk(n)
        fits, losses = self._units(xs, ys, step, exponents=None)
        if not fits:  # a unit past the headroom (rare): measure every parameter's range, then once more
            self.redone += 1
            self._units(xs, ys, step, measure=True)
            fits, losses = self._units(xs, ys, step, exponents=self.grads.measured())
            if not fits:
                raise TrainingError("InvariantStep: the step overflowed at exponents from its own maxima (a bug)")
        return math.fsum(losses.tolist()) / self.units

    def _units(self, xs, ys, step: int, exponents=None, measure: bool = False):
        """This replica's units, one forward and backward each; (every conversion fitted, the units' losses
        maxed over the replicas: each has exactly one)."""
        losses = torch.full((self.units,), -math.inf, dtype=torch.float64)
        self.grads.begin(exponents, measure=measure)
        with self.quiet():
            for j, k in enumerate(self.mine):
                torch.manual_seed(unit_seed(self.seed, step, self.first + k))
                with self.forward_context():
                    loss = self.loss_fn(self.module(xs[j]), ys[j])
                loss.backward()
                losses[k] = float(loss.detach())
                self.grads.end_unit()
        if measure:
            return True, losses
        return self.grads.finish(losses)


def clip_exact(grads: list[torch.Tensor], max_norm: float, *, addends: int, all_reduce=None,
               counted: list | None = None) -> float:
    """Scale ``grads`` so that the global L2 norm is at most ``max_norm`` (torch's rule: coefficient
    max_norm / (norm + 1e-6), at most 1); returns the norm. The squares (exact in float64) are summed by
    ``fixed_point.exact_sum``, so the norm has the same bits however the elements are spread over tensors
    and ranks; ``all_reduce(t, op)`` sums/maxes over the ranks that hold parts (None: all are here).
    ``counted`` (parameters): only their gradients enter the norm (a tensor-parallel rank's shards and,
    on one rank of the group, the replicated ones); all of ``grads`` are scaled."""
    terms = grads if counted is None else [p.grad for p in counted]
    norm = math.sqrt(exact_sum([g.detach().to(torch.float64).square() for g in terms if g is not None],
                               addends=addends, all_reduce=all_reduce))
    coef = min(1.0, max_norm / (norm + 1e-6))
    if coef < 1.0:
        for g in grads:
            if g is not None:
                g.mul_(coef)
    return norm


__all__ = ["InvariantStep", "clip_exact"]
