"""The islands' mean of Δ as a fixed-point int64 sum: its bits depend on the K outer gradients alone
(``--layout-invariant``; docs/determinism.md).

A float all-reduce adds the K islands' Δ_i in the ring's order, and float addition is not associative, so
the mean's bits follow the algorithm and the group. Here every island's Δ_i is converted to integers at one
exponent per tensor shared by all islands, ``q_i = round(Δ_i · 2**e_t)`` (distrain.parallel.invariant's
primitives), the integers are summed by an int64 all-reduce (exact, any order), and each element comes back
once as ``float(Σ_i q_i) · 2**-e_t / K``. The exponent comes from the largest |Δ_i| of the tensor over every
island (one all-reduce, max: exact), so no conversion can overflow (no redo, unlike the gradients' sums,
whose exponents are chosen before later units are seen): with ``e_t = limit_bits(K) − magnitude(max)``
every |q_i| < 2**limit_bits(K), and K of them sum below 2**62.

So the mean is a function of the multiset {Δ_1 .. Δ_K} alone: the same bits whatever ranks each island has,
and the same as a one-process sum of the K deltas at the same exponents (tests/test_diloco_invariant.py's
simulation does it with the same primitives). A tensor whose largest |Δ| is not finite comes back NaN (the islands' parameters were already).
"""

from __future__ import annotations

import math

import torch

from distrain import comm
from distrain.parallel.invariant.fixed_point import maxima, quantize, scale_exponents


def exponents_of(flat: torch.Tensor, sizes: list[int], islands: int, group=None,
                 tensors: tuple[int, list[int]] | None = None) -> tuple[list[int], list[bool]]:
    """(one exponent per piece of ``flat`` (pieces of ``sizes`` elements, in order), whether the piece's
    largest |value| over the group is finite): one all-reduce (max) over ``group`` (None: this rank alone).

    ``tensors`` (DiLoCo's grid islands, whose ranks hold pieces of tensors: tp slices, ZeRO-3's flat shards'
    parts): (the whole model's tensor count T, each piece's tensor among them). The maxima are then per
    whole tensor, a (T,) vector with each piece's at its tensor (0 where this rank holds none: |Δ| >= 0),
    all-reduced (max) over the whole world, which holds every piece of every island: each piece gets its
    tensor's exponent, the one a rank holding the whole tensor (a plain island) computes."""
    top = maxima(list(flat.split(sizes)))
    if tensors is not None:
        count, index = tensors
        whole = torch.zeros(count, dtype=top.dtype)
        for i, m in zip(index, top.tolist()):
            whole[i] = max(float(whole[i]), m) if math.isfinite(m) else m
        comm.all_reduce(whole, op="max", algorithm="native")  # (None: the world)
        top = whole[torch.tensor(index, dtype=torch.long)] if index else top
    elif group is not None:
        comm.all_reduce(top, op="max", group=group, algorithm="native")
    reference = top.tolist()
    return scale_exponents(reference, islands, headroom=0), [math.isfinite(m) for m in reference]


def to_integers(flat: torch.Tensor, sizes: list[int], exponents: list[int]) -> torch.Tensor:
    """(n,) int64: each piece of ``flat`` times 2**e of its piece, rounded half to even (fixed_point.quantize)."""
    return torch.cat([quantize(piece, e) for piece, e in zip(flat.split(sizes), exponents)])


def from_integers(total: torch.Tensor, sizes: list[int], exponents: list[int], finite: list[bool], islands: int,
                  out: torch.Tensor) -> torch.Tensor:
    """``out`` (n,) ← ``float(total) · 2**-e / islands`` per piece (in float64, one rounding to ``out``'s dtype),
    NaN for a piece whose largest |Δ| was not finite."""
    x = total.to(torch.float64)
    for piece, e, ok in zip(x.split(sizes), exponents, finite):
        if ok:
            piece.mul_(2.0 ** -e).div_(islands)
        else:
            piece.fill_(math.nan)
    return out.copy_(x)


def islands_mean(value: float, island: int, islands: int, group=None) -> torch.Tensor:
    """Collective over ``group`` (the cross group: one rank of each island; None: one island): the mean of the
    K islands' ``value`` (each the same on every rank of its island, here island ``island``'s), float64 with the
    same bits on any layout: each island writes its slot of a (K,) vector (one contributor per slot, so the
    all-reduce's sum is exact in any order), then math.fsum (exactly rounded) over K."""
    values = torch.zeros(islands, dtype=torch.float64)
    values[island] = value
    if group is not None:
        comm.all_reduce(values, op="sum", group=group, algorithm="native")
    return torch.tensor(math.fsum(values.tolist()) / islands, dtype=torch.float64)


__all__ = ["exponents_of", "from_integers", "islands_mean", "to_integers"]
