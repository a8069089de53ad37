"""Clipping by the global gradient norm, one function for every sharding.

``torch.nn.utils.clip_grad_norm_`` (Pascanu et al. 2013, "On the difficulty of training recurrent
neural networks") scales every gradient by ``min(1, max_norm / (||g|| + 1e-6))`` where ``||g||`` is
the L2 norm of the whole model's gradient. When the model is split, no rank holds all of ``g``; what
each rank holds differs by layout, so each layout says which of its gradients count and how often:

* one process, or replicas holding the same averaged gradient (DDP): every gradient once, no
  communication (``reduce=False``);
* ZeRO: each rank's flat shard once, summed over its group (padding is zero);
* the dp x cp x tp x pp grid: summed over the world and divided by the dp x cp replicas that hold
  the same shard; a tensor-parallel-replicated parameter counted on tp rank 0 only (weight 0
  elsewhere), an expert's gradient (held by dp x cp / ep of the replicas) ``ep`` times.

Squares are summed in float64 in the order the terms are given, then one all-reduce; the scale is
computed in float64 and applied as a Python float (so a bfloat16 gradient is multiplied at float
precision, as a scalar multiply does, not by a rounded bfloat16 factor).
"""

from __future__ import annotations

from typing import Iterable

import torch

from distrain import comm
from distrain.errors import ConfigError

Weight = float | int | torch.Tensor  # a multiplicity, or a 0/1 mask over the gradient's elements


@torch.no_grad()
def clip_grad_norm(terms: Iterable[tuple[torch.Tensor | None, Weight]], max_norm: float, *, reduce: bool = False,
                   group=None, algorithm: str = "native", replicas: int = 1) -> float:
    """Scale the gradients of ``terms`` so that the global L2 norm is at most ``max_norm``; return the
    norm before clipping.

    ``terms``: (gradient, weight) pairs; the squared norm is ``sum(weight * g**2)`` over them (a None
    gradient is skipped, so is a weight of 0: the term is not counted here, but still scaled).
    ``reduce``: sum that over ``group`` (None: the world) with ``algorithm``; ``replicas``: how many
    ranks of that group counted the same terms (the sum is divided by it)."""
    if not max_norm > 0:
        raise ConfigError(f"clip_grad_norm: max_norm must be positive, got {max_norm}")
    terms = [(g, w) for g, w in terms if g is not None]
    device = terms[0][0].device if terms else None
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for g, w in terms:
        if torch.is_tensor(w):
            sq += (g.double().pow(2) * w).sum()
        elif w:
            sq += g.double().pow(2).sum() * w
    if reduce:
        comm.all_reduce(sq, op="sum", group=group, algorithm=algorithm)
    norm = (sq / replicas).sqrt()  # (x / 1 is x: exact)
    coef = float((max_norm / (norm + 1e-6)).clamp(max=1.0))
    if coef < 1.0:
        for g, _ in terms:
            g.mul_(coef)
    return float(norm)


__all__ = ["clip_grad_norm"]
