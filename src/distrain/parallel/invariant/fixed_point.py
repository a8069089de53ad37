"""Sums whose bits do not depend on how they are split or ordered: shared fixed-point scales, integer addition.

Floating-point addition is not associative, so a gradient summed over 4 ranks in a ring, over 3, or
accumulated over 8 micro-batches on one process gives three different float32 results. Integer
addition is associative, and a float is an integer times a power of two. So each addend ``g`` is
converted to ``q = round(g * 2**e)`` (int64) with one exponent ``e`` shared by every addend of the same
element, the integers are added in any order and grouping (exact while the sum fits), and the sum comes
back once: ``float(sum) * 2**-e``. The result is a function of the multiset of addends alone (the
"conversion to a shared fixed-point scale" family of reproducible summation; ReproBLAS's binned sums,
Demmel & Nguyen 2013-2015, use several such bins to cover any range, one bin is enough here because the
scale is chosen from the data: :func:`scale_exponents`).

Accuracy. With ``u`` addends of magnitude below ``2**E`` and ``e = 62 - ceil(log2 u) - H - E`` (H bits of
headroom), each conversion rounds by at most ``2**-(e+1)``: an element as large as the largest is kept to
about 2**-(62 - log2 u - H) relative (2**-48 for u = 64, H = 8: float32 keeps 2**-24), and an element
2**24 times smaller than the largest still has float32's precision. The sum is then within u rounding
steps of the exact sum before its one rounding back to float32; a plain float32 sum of u addends is
within about u float32 roundings (2**-24 each), so the fixed-point sum is the more accurate of the two.
Squares for a norm (:func:`exact_sum`) are exact in float64 (a float32 square has 48 significant bits).
"""

from __future__ import annotations

import math

import torch

INT_BITS = 62          # |sum| < 2**62 keeps int64 addition exact with a bit to spare
HEADROOM_BITS = 8      # later addends may be 256x the one the scale was chosen from


def limit_bits(addends: int) -> int:
    """Bits a single addend may use so that ``addends`` of them sum below 2**INT_BITS."""
    return INT_BITS - max(0, math.ceil(math.log2(max(1, addends))))


def magnitude(x: float) -> int:
    """E with x < 2**E (x >= 0 finite; 0 -> a very small E)."""
    if x == 0:
        return -1100
    return math.frexp(x)[1]


def scale_exponents(reference: list[float], addends: int, headroom: int = HEADROOM_BITS) -> list[int]:
    """One exponent per tensor from a reference maximum |value| per tensor (the same on every rank and
    layout): ``limit_bits(addends) - headroom - magnitude(max)``. A tensor whose reference is 0 (no gradient
    in unit 0, e.g. an expert no token of it reached) or not finite is scaled as if its reference were 1.0:
    a rule of its own, so that no rank needs the other tensors' references (a pipeline stage holds only its
    own); a gradient past 2**headroom then takes the redo."""
    bits = limit_bits(addends) - headroom
    return [min(1000, bits - magnitude(m if (m > 0 and math.isfinite(m)) else 1.0)) for m in reference]


def quantize(g: torch.Tensor, exponent: int) -> torch.Tensor:
    """round(g * 2**exponent) as int64, rounding half to even. Scaling by a power of two is exact while
    the result stays a normal number, so float32 and bfloat16 (8 exponent bits: 2**e up to 2**127) scale and
    round in their own dtype, at half float64's memory traffic; other dtypes, and exponents out of that
    range, in float64. Either way the integer is round() of the exact product: the same bits."""
    g = g.detach()
    if g.dtype in (torch.float32, torch.bfloat16) and 0 <= exponent <= 120:
        return torch.mul(g, 2.0 ** exponent).round_().to(torch.int64)
    return torch.mul(g.to(torch.float64), 2.0 ** exponent).round_().to(torch.int64)  # (never in place: g may be float64)


def quantize_flat_(flat: torch.Tensor, views: list[torch.Tensor], exponents: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``views`` (consecutive pieces of ``flat``, which they cover from its start) each times 2**e and rounded
    IN PLACE, then as int64: (the integers of the covered part, its largest |g * 2**e| as a float64 0-d
    tensor, NaN if any). float32 and bfloat16 scale in their own dtype when every exponent is in the float32
    range (exact: a power of two), others in float64; either way the integers are ``quantize``'s."""
    n = sum(v.numel() for v in views)
    if flat.dtype in (torch.float32, torch.bfloat16) and all(0 <= e <= 120 for e in exponents):
        torch._foreach_mul_([v.reshape(-1) for v in views], [2.0 ** e for e in exponents])
        scaled = flat[:n]
    else:
        scaled = flat[:n].to(torch.float64)
        pieces, o = [], 0
        for v in views:
            pieces.append(scaled[o:o + v.numel()])
            o += v.numel()
        torch._foreach_mul_(pieces, [2.0 ** e for e in exponents])
    lo, hi = torch.aminmax(scaled)
    return scaled.round_().to(torch.int64), torch.maximum(hi, -lo).to(torch.float64)


def maxima(tensors: list[torch.Tensor]) -> torch.Tensor:
    """(len(tensors),) float64: each tensor's largest |value| (0 for an empty one; NaN propagates)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.stack([m.to(torch.float64) for m in torch._foreach_max(torch._foreach_abs(
        [t.detach().reshape(-1) if t.numel() else t.new_zeros(1) for t in tensors]))])


def dequantize(q: torch.Tensor, exponent: int, divisor: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``float(q) * 2**-exponent / divisor`` in ``dtype`` (into ``out`` when given): to float64, scale,
    divide, one rounding to ``dtype`` (gradients.py does the same in list-wide form). Every step is
    elementwise on the same integers, so the bits depend only on ``q``."""
    x = q.to(torch.float64).mul_(2.0 ** -exponent)
    if divisor != 1:
        x.div_(divisor)
    if out is None:
        return x.to(dtype)
    return out.copy_(x)


def exact_sum(values: list[torch.Tensor], *, addends: int, all_reduce=None) -> float:
    """The sum of every element of ``values`` (any float dtypes, converted to float64 exactly), whatever
    tensors hold them and in whatever order: the largest |element| (``all_reduce(t, "max")`` over the
    ranks that hold parts, when given) sets one scale; the integers are summed (``all_reduce(t, "sum")``).
    ``addends``: an upper bound on the number of elements over all ranks (the same everywhere)."""
    top = torch.zeros((), dtype=torch.float64)
    for v in values:
        if v.numel():
            top = torch.maximum(top, v.detach().abs().max().to(torch.float64).cpu())
    if all_reduce is not None:
        top = all_reduce(top, "max")
    m = float(top)
    if not math.isfinite(m):
        return m
    e = scale_exponents([m], addends, headroom=0)[0]
    total = torch.zeros((), dtype=torch.int64)
    for v in values:
        if v.numel():
            total += quantize(v, e).sum().cpu()
    if all_reduce is not None:
        total = all_reduce(total, "sum")
    return float(total) * 2.0 ** -e


__all__ = ["HEADROOM_BITS", "INT_BITS", "dequantize", "exact_sum", "limit_bits", "magnitude", "maxima", "quantize", "quantize_flat_",
           "scale_exponents"]
