"""Gradient accumulation: one replica's part of the batch as ``steps`` equal chunks, one backward each.

The part (B_d, ...) is cut by ``x.chunk(steps)``; each chunk's loss is divided by ``steps`` (the chunks
are equal, so the sum of their gradients is the gradient of the part's mean loss) and backpropagated.
A data-parallel wrapper synchronises the gradients on the last backward only: ``no_sync()`` around
the others (ours and torch's DDP both have it). Used by the grid engine (``ParallelModel.train_step``)
and the single-process engine and its baselines alike.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accumulate_gradients(net: nn.Module, loss_fn: Loss, x: torch.Tensor, y: torch.Tensor, steps: int = 1, *,
                         forward_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                         before_last_backward: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Forward and backward of ``(x, y)`` in ``steps`` equal chunks; returns the sum of the chunks' losses
    (each divided by ``steps``: the part's mean loss) as a float64 scalar.

    ``forward_context()`` wraps each forward and loss (e.g. autocast); ``before_last_backward(loss)`` runs
    just before the last chunk's backward (e.g. DDP's ``carry`` of values that ride with the gradients)."""
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i, (xi, yi) in enumerate(zip(x.chunk(steps), y.chunk(steps))):
        last = i == steps - 1
        quiet = net.no_sync() if not last and hasattr(net, "no_sync") else contextlib.nullcontext()
        with quiet:
            with forward_context():
                loss = loss_fn(net(xi), yi) / steps  # the mean over the part: equal chunks
            if last and before_last_backward is not None:
                before_last_backward(loss.detach())
            loss.backward()
        total += loss.detach().double()
    return total


__all__ = ["accumulate_gradients"]
