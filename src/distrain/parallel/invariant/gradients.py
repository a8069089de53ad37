"""``FixedPointGradients``: a step's gradients summed over its units and ranks in int64, so the bits do not
depend on the layout.

Every unit of work (a fixed number of samples: units.py) runs its own forward and backward; each
parameter's gradient of that unit is converted at once to integers at the parameter's exponent and added to
an int64 accumulator (the float gradient is dropped: ``p.grad = None``), so no float addition ever
combines two units. The accumulators are flat per ``FlatUnit`` (ZeRO's buckets and layers, or one bucket of
the whole module), so at the end one int64 all-reduce (replicas: DDP, one process) or reduce-scatter (ZeRO:
each rank's shard) sums the ranks, and each element comes back once as ``float(sum) * 2**-e / units``.

The exponents. They must be the same in every layout and known before the first conversion, so they come
from global unit 0, which the first data-parallel replica always runs first: after each replica's first
unit, the largest |gradient| of every parameter on that replica is broadcast from the first replica
(``calibrate``), and each exponent leaves HEADROOM_BITS for later units (fixed_point.scale_exponents).
A later unit with a gradient past that headroom is an overflow: ``finish`` reports it after one all-reduce
(max) of every parameter's largest |gradient| over the step's units, the same decision on every rank, and
the caller runs the step again with exponents from those maxima (fixed_point: the redo cannot overflow).

Parameter gradients arrive either through autograd (a post-accumulate-grad hook per parameter: DDP, ZeRO 1
and 2 under ``no_sync()``, one process) or as a ZeRO-3 layer's whole flat gradient (``take_flat``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm
from distrain.parallel.invariant.fixed_point import abs_max, dequantize, fits, quantize, scale_exponents
from distrain.parallel.zero.layout import FlatUnit


class FixedPointGradients:
    """Int64 gradient accumulators over ``units`` (FlatUnits; ``params[i]``: unit i's parameters, or None
    for a ZeRO-3 layer whose gradients come through :meth:`take_flat`), summed over ``group`` (None: no
    other rank); ``addends``: the step's units of work over all ranks (the divisor, and the headroom);
    ``src``: the global rank of the replica that runs unit 0; ``tp_group`` (tensor parallelism: each rank
    holds its shards, the same parameter list on every tp rank): the exponents and the overflow decision
    take the maximum over it too, so a sharded parameter's exponent is its whole tensor's, as on one process."""

    def __init__(self, units: list[FlatUnit], params: list[list[nn.Parameter]] | None, *, addends: int,
                 group=None, src: int = 0, hooks: bool = True, tp_group=None):
        self.units, self.addends, self.group, self.src = units, addends, group, src
        self.tp_group = tp_group if (tp_group is not None and dist.get_world_size(tp_group) > 1) else None
        self.params = params
        self.slots: list[tuple[int, int, int]] = []  # per parameter: (unit, offset, numel), in unit order
        for i, u in enumerate(units):
            for o, s in zip(u.offsets, u.shapes):
                self.slots.append((i, o, s.numel()))
        self.acc = [torch.zeros(u.padded, dtype=torch.int64) for u in units]
        self.exponents: list[int] | None = None
        self.maxima = torch.zeros(len(self.slots), dtype=torch.float64)
        self.active = False
        self._stash: dict[int, torch.Tensor] = {}  # ZeRO-3, before calibration: unit -> flat gradient
        self._index = {}
        if params is not None:
            k = 0
            for ps in params:
                for p in ps:
                    self._index[id(p)] = k
                    k += 1
            if hooks:
                for ps in params:
                    for p in ps:
                        p.register_post_accumulate_grad_hook(self._on_grad)

    # -- a step ----------------------------------------------------------------------------------
    def begin(self, exponents: list[int] | None = None) -> None:
        """A step's first unit follows; ``exponents`` (a redo) or None (calibrate on the first unit)."""
        for a in self.acc:
            a.zero_()
        self.maxima.zero_()
        self.exponents = exponents
        self._stash.clear()
        self.active = True

    def _add(self, k: int, g: torch.Tensor) -> None:
        i, o, n = self.slots[k]
        m = abs_max(g)
        if not m <= self.maxima[k]:  # (NaN propagates: the step's grads become NaN below)
            self.maxima[k] = m
        if fits(m, self.exponents[k], self.addends):
            self.acc[i][o:o + n].add_(quantize(g.reshape(-1), self.exponents[k]))

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.active or self.exponents is None:
            return  # (before calibration the first unit's gradient waits in p.grad)
        self._add(self._index[id(p)], p.grad)
        p.grad = None

    def take_flat(self, i: int, flat: torch.Tensor) -> None:
        """A ZeRO-3 layer's (unit i's) whole padded flat gradient of the current unit of work."""
        if self.exponents is None:
            self._stash[i] = flat if i not in self._stash else self._stash[i] + flat
            return
        u = self.units[i]
        base = sum(len(v.offsets) for v in self.units[:i])
        for j, (o, s) in enumerate(zip(u.offsets, u.shapes)):
            self._add(base + j, flat[o:o + s.numel()])

    def end_unit(self) -> None:
        """After each unit's backward: the first one sets the exponents (a broadcast from ``src``)."""
        if self.exponents is not None:
            return
        local = torch.zeros(len(self.slots), dtype=torch.float64)
        pending = self._pending()
        for k, g in pending.items():
            local[k] = abs_max(g)
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.broadcast(local, src=self.src, group=self.group, algorithm="native")
        if self.tp_group is not None:  # a shard's maximum -> its whole parameter's
            comm.all_reduce(local, op="max", group=self.tp_group, algorithm="native")
        self.exponents = scale_exponents(local.tolist(), self.addends)
        for k, g in pending.items():
            self._add(k, g)
        if self.params is not None:
            for ps in self.params:
                for p in ps:
                    p.grad = None
        self._stash.clear()

    def _pending(self) -> dict[int, torch.Tensor]:
        """Parameter index -> the first unit's gradient (waiting for the exponents)."""
        out = {}
        if self.params is not None:
            for ps in self.params:
                for p in ps:
                    if p.grad is not None:
                        out[self._index[id(p)]] = p.grad
            return out
        for i, flat in self._stash.items():
            u = self.units[i]
            base = sum(len(v.offsets) for v in self.units[:i])
            for j, (o, s) in enumerate(zip(u.offsets, u.shapes)):
                out[base + j] = flat[o:o + s.numel()]
        return out

    def finish(self, extra: torch.Tensor | None = None) -> tuple[list[int] | None, torch.Tensor | None]:
        """After the last unit: one all-reduce (max) of every parameter's largest |gradient| (with
        ``extra``, float64, maxed alongside). Returns (None, extra) when every conversion fitted, else
        (the exponents to run the step again with, extra): the same answer on every rank."""
        self.active = False
        both = self.maxima if extra is None else torch.cat([self.maxima, extra.to(torch.float64)])
        if self.group is not None and dist.get_world_size(self.group) > 1:
            comm.all_reduce(both, op="max", group=self.group, algorithm="native")
        if self.tp_group is not None:
            comm.all_reduce(both, op="max", group=self.tp_group, algorithm="native")
        maxima, extra = both[:len(self.slots)], (None if extra is None else both[len(self.slots):])
        m = maxima.tolist()
        if all(fits(v, e, self.addends) for v, e in zip(m, self.exponents) if not math.isnan(v)):
            self._nan = [math.isnan(v) or math.isinf(v) for v in m]
            return None, extra
        return scale_exponents(m, self.addends), extra

    # -- the sum over ranks, back to floats --------------------------------------------------------
    def gradients(self) -> None:
        """Replicas (DDP, one process): all-reduce the integers, write every parameter's ``.grad``."""
        for i, a in enumerate(self.acc):
            if self.group is not None and dist.get_world_size(self.group) > 1:
                comm.all_reduce(a, op="sum", group=self.group, algorithm="native")
        k = 0
        for i, ps in enumerate(self.params):
            for p, v in zip(ps, self.units[i].views(self.acc[i])):
                p.grad = self._back(k, v, p.dtype)
                k += 1

    def shard_gradients(self, rank: int, world: int, dtypes: list[torch.dtype]) -> list[torch.Tensor]:
        """ZeRO: reduce-scatter the integers; rank's shard of every unit's gradient, (S,) in ``dtypes[i]``."""
        out = []
        base = 0
        for i, (u, a) in enumerate(zip(self.units, self.acc)):
            mine = torch.empty(u.shard, dtype=torch.int64)
            comm.reduce_scatter(mine, list(a.view(world, u.shard)), op="sum", group=self.group, algorithm="native")
            lo, hi = u.shard_range(rank)
            g = torch.zeros(u.shard, dtype=dtypes[i])
            for j, (o, s) in enumerate(zip(u.offsets, u.shapes)):
                a0, b0 = max(o, lo), min(o + s.numel(), hi)
                if a0 < b0:
                    g[a0 - lo:b0 - lo] = self._back(base + j, mine[a0 - lo:b0 - lo], dtypes[i])
            base += len(u.offsets)
            out.append(g)
        return out

    def _back(self, k: int, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self._nan[k]:
            return torch.full(q.shape, math.nan, dtype=dtype)
        return dequantize(q, self.exponents[k], self.addends, dtype)


__all__ = ["FixedPointGradients"]
