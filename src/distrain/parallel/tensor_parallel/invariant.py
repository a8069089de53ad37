"""Tensor parallelism with the same bits on every tp size (``--layout-invariant``; docs/determinism.md).

Splitting a matmul's output columns or rows over ranks leaves every element's bits as they were; splitting
a *reduction* does not: float addition is not associative, so a row-parallel output summed over 2 ranks,
over 4, or computed by one matmul on one process differs in the last bits. So in invariant mode every
reduction that tensor parallelism splits is computed the same way in every layout, one process included:
the reduced dimension is cut into C fixed *chunks* (C = the group's ``chunks``, the largest tp the run may
use), each chunk's partial is its own kernel call on the same shapes everywhere, and the partials are added
in one fixed binary tree, ``((p0 + p1) + (p2 + p3))`` for C = 4. Rank r of P holds the contiguous chunks
[r*C/P, (r+1)*C/P), adds them as the left or right subtree, and the ranks' subtrees are all-gathered and
added in the same tree (:func:`combine`): the result is the same tree whatever P divides C.

    reduction                                 where                       here
    row-parallel output (sum over C)          RowParallelLinear forward   chunked matmuls + tree + combine
    column-parallel input gradient (sum       f's backward (copy_to_tp,    :func:`chunk_input`: one view of x
      over O, and over q/k/v reading x)         CopyInput)                  per chunk, its gradients added per
                                                                            chunk by autograd, then the tree
    vocab-parallel cross entropy's sum of exp  loss.py                     per-chunk sums + tree + combine
    vocab-parallel embedding                  g of one owner and zeros    the owner's rows, selected (exact)

The column-parallel input gradient needs each chunk's own input: q, k and v (or a SwiGLU's w1 and w3) read
the same x, and autograd adds their input gradients per chunk (``(v_c + k_c) + q_c``, the same order in
every layout) before the tree adds the chunks. :func:`chunk_input` therefore returns one view of x per
local chunk (the first carries the others, for the linears behind a CopyInput that share one f).

Everything else is already invariant: output columns and rows of a matmul (each chunk has the same shape
in every layout), elementwise ops, LayerNorm/RMSNorm rows, attention over whole heads; the maximum of the
cross entropy is exact, and so is its target logit (one rank's value and zeros).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.group import TPGroup

INVARIANT_CHUNKS = 4  # C: the largest tp size a --layout-invariant run may use


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """``((p0 + p1) + (p2 + p3))``: pairwise, left to right, level by level (a power of two parts)."""
    parts = list(parts)
    if len(parts) & (len(parts) - 1):
        raise ConfigError(f"tree_sum: {len(parts)} parts; the canonical tree needs a power of two")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def combine(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's subtree ``x`` and the other ranks' added in the canonical tree, in rank order: the same
    tensor on every rank (x itself on a group of one)."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    comm.all_gather(parts, x, group=tp.group, algorithm=tp.algorithm)
    return tree_sum(parts)


def local_chunks(tp: TPGroup) -> int:
    """How many of the C chunks this rank holds: C / P."""
    return tp.chunks // tp.size


class _Combine(torch.autograd.Function):
    """g in invariant mode: the canonical sum of the ranks' subtrees forward; identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        return combine(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ChunkInput(torch.autograd.Function):
    """f in invariant mode: k views of x forward (one per local chunk); backward, the chunks' gradients
    added in the canonical tree, then over the ranks (:func:`combine`)."""

    @staticmethod
    def forward(ctx, x, tp, k):
        ctx.tp = tp
        return tuple(x.view_as(x) for _ in range(k))

    @staticmethod
    def backward(ctx, *grads):
        return combine(tree_sum(grads), ctx.tp), None, None


def chunk_input(x: torch.Tensor, tp: TPGroup) -> tuple[torch.Tensor, ...]:
    """f for the column-parallel linears reading ``x`` (..., C): one view of x per local chunk; the first
    carries them all (``tp_chunks``) for the linears behind a CopyInput, and counts its readers."""
    parts = _ChunkInput.apply(x, tp, local_chunks(tp))
    parts[0].tp_chunks = parts
    parts[0].tp_chunk_readers = 0
    return parts


def chunks_of(x: torch.Tensor, sync_input: bool, tp: TPGroup, name: str) -> tuple[torch.Tensor, ...]:
    """The per-chunk inputs of a column-parallel linear: its own f, or the CopyInput's views."""
    if sync_input:
        return chunk_input(x, tp)
    parts = getattr(x, "tp_chunks", None)
    if parts is None:
        raise ConfigError(f"--layout-invariant: {name} (column-parallel, sync_input=False) got an input that did "
                          f"not come from its CopyInput unchanged; the tensor-parallel plan must put the module "
                          f"whose input feeds it under CopyInput and pass that input to it as is")
    x.tp_chunk_readers += 1
    return parts


def column_linear(parts: tuple[torch.Tensor, ...], weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., C) per chunk -> (..., O/P): each local chunk of output features its own matmul on its own
    view of the input (so its input gradient stays apart until f's tree)."""
    k = len(parts)
    rows = weight.shape[0] // k
    ws = weight.split(rows)
    bs = bias.split(rows) if bias is not None else [None] * k
    return torch.cat([F.linear(x, w, b) for x, w, b in zip(parts, ws, bs)], dim=-1)


def row_linear(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """(..., C/P) -> (..., O), the sum over all C input features: the local chunks' matmuls (contiguous
    copies: the same shapes and strides in every layout) in the canonical tree, then over the ranks."""
    k = local_chunks(tp)
    cols = weight.shape[1] // k
    parts = [F.linear(a.contiguous(), w.contiguous()) for a, w in zip(x.split(cols, dim=-1), weight.split(cols, dim=1))]
    y = tree_sum(parts)
    return y if tp.size == 1 else _Combine.apply(y, tp)


class _OwnerRows(torch.autograd.Function):
    """The vocab-parallel embedding's g in invariant mode: each token's row from the rank owning it (the
    others hold zeros there), selected rather than added (exact, signed zeros included); identity backward."""

    @staticmethod
    def forward(ctx, x, owner, tp):
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(tp.size)]
        comm.all_gather(parts, x, group=tp.group, algorithm=tp.algorithm)
        out = parts[0]
        for r in range(1, tp.size):
            out = torch.where((owner == r).unsqueeze(-1), parts[r], out)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def owner_rows(x: torch.Tensor, ids: torch.Tensor, rows_per_rank: int, tp: TPGroup) -> torch.Tensor:
    """(..., C) with each token's row on its owner only -> (..., C) on every rank."""
    return _OwnerRows.apply(x, torch.div(ids, rows_per_rank, rounding_mode="floor"), tp)


__all__ = ["INVARIANT_CHUNKS", "chunk_input", "chunks_of", "column_linear", "combine", "local_chunks",
           "owner_rows", "row_linear", "tree_sum"]
