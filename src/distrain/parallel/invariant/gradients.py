"""``FixedPointGradients``: a step's gradients summed over its units and ranks in int64, so the bits do not
depend on the layout.

Every unit of work (a fixed number of samples: units.py) runs its own forward and backward into zeroed
float buffers; right after it, each parameter's gradient is converted to integers at the parameter's
exponent and added to an int64 accumulator, so no float addition ever combines two units. Buffers and
accumulators are flat per ``FlatUnit`` (ZeRO's buckets and layers, or one bucket of the whole module): a
unit's conversion is a few list-wide operations, and at the end one int64 all-reduce (replicas: DDP, one
process) or reduce-scatter (ZeRO: each rank's shard) sums the ranks; each element comes back once as
``float(sum) * 2**-e / units``.

The exponents. They must be the same in every layout and known before the first conversion, so they come
from global unit 0, which the first data-parallel replica always runs first: after each replica's first
unit, the largest |gradient| of every parameter on that replica is broadcast from the first replica, and
each exponent leaves HEADROOM_BITS for later units (fixed_point.scale_exponents). A later unit with a
gradient past that headroom is an overflow: ``finish`` sees it in one all-reduce (max) of the largest
converted value, the same decision on every rank; the caller then runs the step twice more (rare: a unit
256 times unit 0's gradient): once to measure every parameter's largest |gradient| (``measured``), once at
exponents from those maxima, which cannot overflow.

Gradients arrive through autograd into the parameters' ``.grad`` (views of the flat buffers: DDP, ZeRO 1
and 2 under ``no_sync()``, one process) or as a ZeRO-3 layer's whole flat gradient (``take_flat``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm
from distrain.errors import TrainingError
from distrain.parallel.invariant.fixed_point import limit_bits, maxima, quantize_flat_, scale_exponents
from distrain.parallel.zero.layout import FlatUnit


class FixedPointGradients:
    """Int64 gradient accumulators over ``units`` (FlatUnits; ``params[i]``: unit i's parameters, or None
    for ZeRO-3, whose layers' gradients come through :meth:`take_flat`), summed over ``group`` (None: no
    other rank); ``addends``: the step's units of work over all ranks (the divisor, and the headroom);
    ``src``: the global rank of the replica that runs unit 0; ``tp_group`` (tensor parallelism: each rank
    holds its shards, the same parameter list on every tp rank): the exponents and the overflow decision
    take the maximum over it too, so a sharded parameter's exponent is its whole tensor's, as on one process.

    With ``params``, every parameter's ``.grad`` is a view into one flat float buffer per FlatUnit during
    the step (autograd adds a unit's gradient into the zeroed view: 0 + g is g), so each unit's conversion
    is a handful of whole-buffer operations rather than a few per parameter."""

    def __init__(self, units: list[FlatUnit], params: list[list[nn.Parameter]] | None, *, addends: int,
                 group=None, src: int = 0, views: bool = True, tp_group=None):
        self.units, self.addends, self.group, self.src = units, addends, group, src
        self.tp_group = tp_group if (tp_group is not None and dist.get_world_size(tp_group) > 1) else None
        self.params, self.views = params, views  # views: .grad points into the flat buffers during a step
        self.counts = [len(u.offsets) for u in units]  # parameters per unit
        self.acc = [torch.zeros(u.padded, dtype=torch.int64) for u in units]
        self.flat = None if params is None else [torch.zeros(u.padded, dtype=ps[0].dtype, device=ps[0].device)
                                                 for u, ps in zip(units, params)]
        self.exponents: list[int] | None = None
        self.measuring = False
        self.maxima: list[torch.Tensor] | None = None  # a measuring pass: per unit, (its parameters,) max |grad|
        self.peak = torch.zeros((), dtype=torch.float64)
        self._stash: dict[int, torch.Tensor] = {}  # ZeRO-3, before calibration: unit -> flat gradient

    # -- a step ----------------------------------------------------------------------------------
    def begin(self, exponents: list[int] | None = None, measure: bool = False) -> None:
        """A step's first unit follows: with ``exponents`` (a redo), or None (set from the first unit); with
        ``measure``, the units only measure every parameter's largest |gradient| (:meth:`measured`)."""
        for a in self.acc:
            a.zero_()
        self.peak = torch.zeros((), dtype=torch.float64)  # the largest |g * 2**e| converted so far
        self.measuring = measure
        self.maxima = [torch.zeros(c, dtype=torch.float64) for c in self.counts] if measure else None
        self.exponents = exponents
        self._stash.clear()
        if self.params is not None and self.views:
            for u, ps, f in zip(self.units, self.params, self.flat):
                f.zero_()
                for p, v in zip(ps, u.views(f)):
                    p.grad = v

    def _offsets(self, i: int) -> int:
        return sum(self.counts[:i])

    def _add(self, i: int, flat: torch.Tensor) -> None:
        """Unit i's flat gradient of the current unit of work into its accumulator (the exponents known)."""
        u, k = self.units[i], self._offsets(i)
        views = u.views(flat)
        if self.measuring:
            self.maxima[i] = torch.maximum(self.maxima[i], maxima(views))
            return
        # a value past the limit converts to a wrong integer, which does not matter: finish() sees the peak
        # and the step is redone
        q, peak = quantize_flat_(flat, views, self.exponents[k:k + len(views)])  # (flat is spent: zeroed next)
        self.acc[i][:u.numel].add_(q)
        self.peak = torch.maximum(self.peak, peak)

    def take_flat(self, i: int, flat: torch.Tensor) -> None:
        """A ZeRO-3 layer's (unit i's) whole padded flat gradient of the current unit of work."""
        if self.exponents is None and not self.measuring:
            self._stash[i] = flat if i not in self._stash else self._stash[i] + flat
            return
        self._add(i, flat)

    def end_unit(self) -> None:
        """After each unit's backward: the first one sets the exponents (a broadcast from ``src``); every
        unit's gradients go into the integers, and the flat buffers are zeroed for the next unit."""
        flats = self.flat if self.params is not None else [self._stash.get(i) for i in range(len(self.units))]
        if self.params is not None and self.views:
            self._check_views()
        if self.exponents is None and not self.measuring:
            local = torch.zeros(sum(self.counts), dtype=torch.float64)
            if self.group is None or dist.get_rank() == self.src:  # (only the first replica's are used)
                for i, f in enumerate(flats):
                    if f is not None and self.counts[i]:
                        k = self._offsets(i)
                        local[k:k + self.counts[i]] = maxima(self.units[i].views(f))
            if self.group is not None and dist.get_world_size(self.group) > 1:
                comm.broadcast(local, src=self.src, group=self.group, algorithm="native")
            self._tp_max(local)  # a shard's maximum -> its whole parameter's
            self.exponents = scale_exponents(local.tolist(), self.addends)
        for i, f in enumerate(flats):
            if f is not None and self.counts[i]:
                self._add(i, f)
        if self.params is not None:
            for f in self.flat:
                f.zero_()
        self._stash.clear()

    def _check_views(self) -> None:
        """Autograd added each gradient into its view (in place); a backward that replaced a ``.grad``
        (e.g. ``create_graph=True``) would leave the flat buffer without it: refused, not summed wrong."""
        for u, ps, f in zip(self.units, self.params, self.flat):
            for p, o in zip(ps, u.offsets):
                g = p.grad
                if g is not None and (g.untyped_storage().data_ptr() != f.untyped_storage().data_ptr()
                                      or g.storage_offset() != o):
                    raise TrainingError("layout-invariant training: a backward replaced a parameter's .grad instead "
                                       "of adding into it (create_graph=True, or a hook that sets .grad); the "
                                       "units' gradients cannot be summed exactly")

    def finish(self, extra: torch.Tensor | None = None) -> tuple[bool, torch.Tensor | None]:
        """After the last unit: one all-reduce (max) of the largest converted |g * 2**e| (with ``extra``,
        float64, maxed alongside). Returns (whether every conversion fitted, extra): the same answer on every
        rank. A non-finite gradient fits (it makes the step's gradients NaN, which the loop stops on)."""
        both = self.peak.view(1) if extra is None else torch.cat([self.peak.view(1), extra.to(torch.float64)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.all_reduce(both, op="max", group=self.group, algorithm="native")
        self._tp_max(both)
        peak = float(both[0])
        self._nan = not math.isfinite(peak)
        return self._nan or peak < 2.0 ** limit_bits(self.addends), (None if extra is None else both[1:])

    def measured(self) -> list[int]:
        """After a ``begin(measure=True)`` pass: exponents from every parameter's largest |gradient| over the
        step's units and ranks (one all-reduce, max); a pass at them cannot overflow."""
        m = torch.cat(self.maxima) if self.maxima else torch.zeros(0, dtype=torch.float64)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.all_reduce(m, op="max", group=self.group, algorithm="native")
        self._tp_max(m)
        self.measuring = False
        return scale_exponents(m.tolist(), self.addends)

    def _tp_max(self, t: torch.Tensor) -> None:
        if self.tp_group is not None:
            comm.all_reduce(t, op="max", group=self.tp_group, algorithm="native")

    @property
    def nonfinite(self) -> list[bool]:
        """After :meth:`finish`: per parameter, whether some unit's gradient held a NaN or an infinity (its
        summed gradient is then NaN: the step's largest converted value was not finite, so every parameter is
        marked), the same on every rank."""
        return [self._nan] * sum(self.counts)

    # -- the sum over ranks, back to floats --------------------------------------------------------
    def gradients(self) -> None:
        """Replicas (DDP, one process): all-reduce the integers; every parameter's ``.grad`` (a view of the
        flat buffer) gets its element's ``float(sum) * 2**-e / addends``."""
        for i, a in enumerate(self.acc):
            if self.group is not None and dist.get_world_size(self.group) > 1:
                comm.all_reduce(a, op="sum", group=self.group, algorithm="native")
            u, k = self.units[i], self._offsets(i)
            self._back(a, [(o, o + s.numel(), k + j) for j, (o, s) in enumerate(zip(u.offsets, u.shapes))],
                       self.flat[i])
            for p, v in zip(self.params[i], u.views(self.flat[i])):
                p.grad = v

    def shard_gradients(self, rank: int, world: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """ZeRO: reduce-scatter the integers; rank's shard of every unit's gradient, (S,) in ``dtypes[i]``."""
        out = []
        for i, (u, a) in enumerate(zip(self.units, self.acc)):
            mine = torch.empty(u.shard, dtype=torch.int64)
            comm.reduce_scatter(mine, list(a.view(world, u.shard)), op="sum", group=self.group, algorithm="native")
            lo, hi = u.shard_range(rank)
            k = self._offsets(i)
            pieces = [(max(o, lo) - lo, min(o + s.numel(), hi) - lo, k + j)
                      for j, (o, s) in enumerate(zip(u.offsets, u.shapes)) if max(o, lo) < min(o + s.numel(), hi)]
            out.append(self._back(mine, pieces, torch.zeros(u.shard, dtype=dtypes[i])))
        return out

    def _back(self, q: torch.Tensor, pieces: list[tuple[int, int, int]], out: torch.Tensor) -> torch.Tensor:
        """``out[a:b] = float(q[a:b]) * 2**-e_k / addends`` for each (a, b, k) of ``pieces`` (elementwise, in
        float64, one rounding to ``out``'s dtype at the end; the rest of ``out`` is left as it is)."""
        if self._nan:
            return out.fill_(math.nan)
        x = q.to(torch.float64)
        views = [x[a:b] for a, b, _ in pieces]
        torch._foreach_mul_(views, [2.0 ** -self.exponents[k] for _, _, k in pieces])
        if self.addends != 1:
            torch._foreach_div_(views, float(self.addends))
        if pieces:  # (contiguous pieces: one copy of their span)
            a0, b0 = pieces[0][0], pieces[-1][1]
            out[a0:b0].copy_(x[a0:b0])
        return out


__all__ = ["FixedPointGradients"]
