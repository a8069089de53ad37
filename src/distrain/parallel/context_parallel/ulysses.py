"""All-to-all (Ulysses) context parallelism: heads exchanged for sequence around the attention.

Jacobs et al., "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models" (2023). Each of the N ranks holds L = T / N tokens (the
load-balanced layout of :mod:`.load_balance`) of every head. An all-to-all turns that into every
token of h / N heads; attention then runs whole (causal, in the sequence's natural order), and a
second all-to-all turns the output back::

    q (B,h,L,d) -a2a-> (B,h/N,T,d)   k, v (B,g,L,d) -a2a-> (B,g/N,T,d)
    reorder to positions 0..T-1, softmax attention (F.scaled_dot_product_attention), reorder back
    out (B,h/N,T,d) -a2a-> (B,h,L,d)

So N must divide the heads this rank attends with: h and g (the key/value heads) per tp rank;
rank p takes query heads [p*h/N, (p+1)*h/N) and key/value heads [p*g/N, (p+1)*g/N), which are
exactly the ones those queries use (query head i reads kv head i // (h/g)).

Each all-to-all is ``distrain.comm.all_to_all_single(algorithm="p2p")``, one message to every other
rank of the cp group (a direct exchange, as a pairwise all-to-all does): a rank sends (N-1)/N of its
tensor and receives as much. Four all-to-alls forward (q, k, v, out) and four backward (their
gradients), per attention call: :func:`ulysses_bytes`. Label ``"cp-all-to-all"`` in the ledger.
The attention's own autograd (torch's) runs between them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distrain import comm
from distrain.parallel.context_parallel.load_balance import positions

__all__ = ["LABEL", "heads_to_sequence", "sequence_to_heads", "ulysses_attention", "ulysses_bytes"]

LABEL = "cp-all-to-all"


def _all_to_all(blocks: torch.Tensor, cp) -> torch.Tensor:
    """blocks (N, ...): block p goes to rank p of the cp group; returns (N, ...), block p from rank p."""
    got = torch.empty_like(blocks)
    comm.all_to_all_single(got, blocks, group=cp.group, algorithm="p2p", label=LABEL)
    return got


def _seq_to_heads(x: torch.Tensor, cp) -> torch.Tensor:
    """(B, H, L, d) -> (B, H/N, N*L, d): head group p to rank p; the tokens of rank p in slot p."""
    B, H, L, d = x.shape
    N = cp.size
    n = H // N
    got = _all_to_all(x.view(B, N, n, L, d).transpose(0, 1).contiguous(), cp)   # (N, B, n, L, d) by rank
    return got.permute(1, 2, 0, 3, 4).reshape(B, n, N * L, d)


def _heads_to_seq(y: torch.Tensor, cp) -> torch.Tensor:
    """(B, H/N, N*L, d) -> (B, H, L, d): the tokens of rank p go back to rank p, head groups in rank order;
    laid out as (B, L, H, d), so that the caller's transpose(1, 2).reshape(B, L, H*d) is a view."""
    B, n, T, d = y.shape
    N = cp.size
    L = T // N
    got = _all_to_all(y.view(B, n, N, L, d).permute(2, 0, 1, 3, 4).contiguous(), cp)  # (N, B, n, L, d)
    return got.permute(1, 3, 0, 2, 4).reshape(B, L, N * n, d).transpose(1, 2)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, g):
        return _heads_to_seq(g.contiguous(), ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, cp):
        ctx.cp = cp
        return _heads_to_seq(y, cp)

    @staticmethod
    def backward(ctx, g):
        return _seq_to_heads(g.contiguous(), ctx.cp), None


def sequence_to_heads(x: torch.Tensor, cp) -> torch.Tensor:
    """All-to-all with autograd: (B, H, L, d) this rank's tokens of every head -> (B, H/N, T, d)
    every rank's tokens (rank order) of head group ``cp.rank``; backward is the inverse."""
    return _SeqToHeads.apply(x.contiguous(), cp)


def heads_to_sequence(y: torch.Tensor, cp) -> torch.Tensor:
    """The inverse all-to-all of :func:`sequence_to_heads`, with autograd."""
    return _HeadsToSeq.apply(y.contiguous(), cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp, causal: bool = True,
                      scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence by the head/sequence all-to-all:
    q (B,h,L,d), k/v (B,g,L,d) in the load-balanced layout -> (B,h,L,d). N = cp.size must divide
    h and g (the plans check it before start). Collective over the cp group."""
    N = cp.size
    qh, kh, vh = (sequence_to_heads(t, cp) for t in (q, k, v))                   # (B, h/N | g/N, T, d)
    T = qh.shape[2]
    where = torch.cat([positions(T, N, p, q.device) for p in range(N)])          # (T,) position of each slot
    order = torch.argsort(where)                                                 # natural order <- slots
    qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))                # positions 0..T-1
    h, g = qh.shape[1], kh.shape[1]
    if g != h:                                                                   # grouped-query attention
        B, _, _, d = kh.shape
        kh = kh[:, :, None].expand(B, g, h // g, T, d).reshape(B, h, T, d)
        vh = vh[:, :, None].expand(B, g, h // g, T, d).reshape(B, h, T, d)
    y = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, scale=scale)  # (B, h/N, T, d)
    return heads_to_sequence(y.index_select(2, where), cp)                       # slots again -> (B, h, L, d)


def ulysses_bytes(b: int, h: int, g: int, L: int, d: int, N: int, elem_size: int = 4) -> dict[str, int]:
    """Bytes one rank sends (and receives) per all-to-all attention call: (N-1)/N of q, k, v and
    the output forward, of their gradients backward; q and the output are b*h*L*d elements, k
    and v b*g*L*d (L = T/N). Messages: N-1 per all-to-all, 4 all-to-alls each way."""
    q, kv = b * h * L * d * elem_size, b * g * L * d * elem_size
    per = (N - 1) * (2 * q + 2 * kv) // N
    return {"forward": per, "backward": per, "forward_msgs": 4 * (N - 1), "backward_msgs": 4 * (N - 1)}
