"""Causal load balancing: the sequence in 2N chunks, rank i holding chunks i and 2N-1-i (pure).

Under a causal mask, token t attends to t + 1 keys, so a contiguous split of the sequence into N
parts gives the last rank about 2N - 1 times the attention work of the first. Cutting it into 2N
equal chunks of c = T / (2N) tokens and giving rank i the chunks i and 2N-1-i (one from the
front, its mirror from the back) makes every rank's work equal: the chunk pair's key counts add
to the same total for every i. Meta, "The Llama 3 Herd of Models" (2024), section 3.3.2; the
"zigzag" layout of ring attention (Liu et al. 2023 give the ring; Brandon et al., "Striped
Attention", 2023, balance it by striping instead)::

    T = 16, N = 2, c = 4:   chunks 0 1 2 3 -> rank 0 holds chunks 0, 3 = positions 0-3, 12-15
                                              rank 1 holds chunks 1, 2 = positions 4-11

A rank's local sequence (B, 2c, ...) is its two chunks in this order; :func:`positions` gives the
global position of each local token (for position embeddings and the causal mask), :func:`split`
takes a rank's tokens of a whole tensor and :func:`join` puts the ranks' tensors back in order.
``T % (2N) == 0`` is required; :func:`check_length` says so, with the N that fit.
"""

from __future__ import annotations

import torch

from distrain.errors import ConfigError

__all__ = ["check_length", "chunks_of", "fitting_sizes", "join", "positions", "split"]


def fitting_sizes(T: int) -> list[int]:
    """The cp sizes N for which 2N divides a sequence of ``T`` tokens."""
    return [n for n in range(1, T // 2 + 1) if T % (2 * n) == 0] or [1]


def check_length(T: int, N: int, what: str = "the sequence") -> None:
    """ConfigError unless ``T`` splits into 2N equal chunks (N = 1: anything goes)."""
    if N > 1 and T % (2 * N):
        raise ConfigError(f"context parallelism (cp={N}) cuts {what} into 2 x cp = {2 * N} equal chunks (causal load "
                          f"balancing gives rank i the chunks i and {2 * N - 1}-i), but {T} tokens do not divide by "
                          f"{2 * N}: choose cp among {', '.join(map(str, fitting_sizes(T)))}, or a length that is a "
                          f"multiple of {2 * N}")


def chunks_of(rank: int, N: int) -> tuple[int, int]:
    """The two chunks (of 2N) that ``rank`` holds, in local order: (rank, 2N-1-rank)."""
    return rank, 2 * N - 1 - rank


def positions(T: int, N: int, rank: int, device=None) -> torch.Tensor:
    """Global positions of ``rank``'s T / N local tokens in a sequence of ``T``: (T/N,) int64,
    [rank*c, (rank+1)*c) then [(2N-1-rank)*c, (2N-rank)*c), c = T / (2N)."""
    check_length(T, N)
    if N == 1:
        return torch.arange(T, device=device)
    c = T // (2 * N)
    a, b = chunks_of(rank, N)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def split(x: torch.Tensor, N: int, rank: int, dim: int = 1) -> torch.Tensor:
    """``rank``'s tokens of the whole tensor ``x`` along ``dim`` (T -> T/N), as a new tensor."""
    T = x.shape[dim]
    if N == 1:
        return x
    check_length(T, N)
    return x.index_select(dim, positions(T, N, rank, x.device))


def join(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`split`: every rank's tensor (rank order) -> the whole sequence."""
    N = len(parts)
    if N == 1:
        return parts[0]
    T = parts[0].shape[dim] * N
    order = torch.cat([positions(T, N, r, parts[0].device) for r in range(N)])  # (T,) where each local token goes
    return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(order))
