"""Sequence parallelism: Megatron's regions outside the split linears, sharded along the sequence.

Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (2022),
section 4.2. Plain tensor parallelism leaves LayerNorm, dropout and the residual stream
replicated: every tp rank holds the whole (B, T, C) there. Sequence parallelism shards these
regions along the sequence, (B, T/P, C) per rank, and swaps the f/g all-reduces for the two
halves of an all-reduce (a ring all-reduce *is* a reduce-scatter then an all-gather, so the
bytes on the wire do not change):

    op                         forward                          backward
    gather_from_sequence       all-gather (B,T/P,C) -> (B,T,C)  reduce-scatter of the grad
    reduce_scatter_to_sequence reduce-scatter (B,T,C) -> T/P    all-gather of the grad
    split_to_sequence          keep this rank's T/P rows        all-gather of the grad

    block  x (B,T/P,C) -> LN -> gather -> q,k,v column -> attention -> o_proj row ->
           reduce-scatter (B,T/P,C) + bias -> + x -> LN -> gather -> fc -> GELU -> proj ->
           reduce-scatter + bias -> + x                                     (B,T/P,C)

Rank r holds sequence rows [r*T/P, (r+1)*T/P). Parameters used on sequence shards (the
LayerNorms, the biases added after a reduce-scatter) see only this rank's tokens, so their
gradients are partial: :func:`sync_grads_over_tp` sums each incoming gradient over the group
(a tensor hook, once per backward contribution, so gradient accumulation stays exact).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.weak import WeakIdKeyDictionary

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.group import TPGroup, as_tp_group


def _rows(x: torch.Tensor, tp: TPGroup, dim: int) -> int:
    T = x.shape[dim]
    if T % tp.size:
        raise ConfigError(f"sequence parallel: the sequence length {T} (dim {dim} of {tuple(x.shape)}) is not "
                          f"divisible by tp={tp.size}; use a length that is a multiple of {tp.size}")
    return T // tp.size


def _all_gather_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    x = x.movedim(dim, 0).contiguous()                                  # (T/P, ...)
    out = torch.empty((tp.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(list(out.chunk(tp.size)), x, group=tp.group, algorithm=tp.algorithm)
    return out.movedim(0, dim).contiguous()                             # (..., T, ...), rank order


def _reduce_scatter_dim(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    rows = _rows(x, tp, dim)
    parts = [p.contiguous() for p in x.movedim(dim, 0).split(rows)]    # P x (T/P, ...)
    out = torch.empty_like(parts[0])
    comm.reduce_scatter(out, parts, group=tp.group, algorithm=tp.algorithm)
    return out.movedim(0, dim)                                          # (..., T/P, ...), summed


def _my_rows(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    rows = _rows(x, tp, dim)
    return x.narrow(dim, tp.rank * rows, rows).contiguous()


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return _all_gather_dim(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_dim(grad, ctx.tp, ctx.dim), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return _reduce_scatter_dim(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


class _SplitSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp, dim):
        ctx.tp, ctx.dim = tp, dim
        return _my_rows(x, tp, dim)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_dim(grad, ctx.tp, ctx.dim), None, None


def gather_from_sequence(x: torch.Tensor, group=None, algorithm: str = "native", dim: int = 1) -> torch.Tensor:
    """(..., T/P, ...) sequence shards -> (..., T, ...) on every rank; backward reduce-scatters."""
    tp = as_tp_group(group, algorithm)
    return x if tp.size == 1 else _GatherSeq.apply(x, tp, dim)


def reduce_scatter_to_sequence(x: torch.Tensor, group=None, algorithm: str = "native", dim: int = 1) -> torch.Tensor:
    """(..., T, ...) partial sums -> this rank's (..., T/P, ...) rows of the sum; backward all-gathers."""
    tp = as_tp_group(group, algorithm)
    return x if tp.size == 1 else _ReduceScatterSeq.apply(x, tp, dim)


def split_to_sequence(x: torch.Tensor, group=None, algorithm: str = "native", dim: int = 1) -> torch.Tensor:
    """(..., T, ...) replicated -> this rank's (..., T/P, ...) rows; backward all-gathers."""
    tp = as_tp_group(group, algorithm)
    return x if tp.size == 1 else _SplitSeq.apply(x, tp, dim)


class _Ref:
    """A saved tensor that lived in the all-gathered input: its geometry, to rebuild it."""

    def __init__(self, size, stride, offset):
        self.size, self.stride, self.offset = size, stride, offset


class RegatherSaved:
    """``saved_tensors_hooks`` for the layers reading an all-gathered input (B, T, C): what autograd
    saves from it (the input of q/k/v, fc, lm_head, for their weight gradients) is kept as this
    rank's shard (B, T/P, C) and all-gathered again in backward, once for all its users -- the
    paper's trade of one extra all-gather for P times less memory (Korthikanti et al., 4.2.2).

    Hooks installed around this one (activation offloading, a memory probe) still see every
    saved tensor: the others pass through them, and the shard goes through them once."""

    def __init__(self, full: torch.Tensor, shard: torch.Tensor, tp: TPGroup, dim: int):
        self.ptr = full.untyped_storage().data_ptr()
        self.shard, self.tp, self.dim = shard.detach(), tp, dim
        self.pending = 0
        self.full: torch.Tensor | None = None
        # the enclosing saved-tensor hooks, if any (torch applies only the innermost pair)
        self.outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        self.kept = None  # the shard as the outer hooks packed it
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor):
        if t.untyped_storage().data_ptr() != self.ptr:
            return (None, self.outer[0](t)) if self.outer else t
        if self.pending == 0:
            self.kept = self.outer[0](self.shard) if self.outer else self.shard
        self.pending += 1
        return _Ref(t.shape, t.stride(), t.storage_offset())

    def unpack(self, packed):
        if not isinstance(packed, _Ref):
            return self.outer[1](packed[1]) if self.outer else packed
        if self.full is None:  # the first user in backward gathers; the last one lets it go
            shard = self.outer[1](self.kept) if self.outer else self.kept
            self.full = _all_gather_dim(shard, self.tp, self.dim)
        full = self.full
        self.pending -= 1
        if self.pending == 0:
            self.full = None
        return full.as_strided(packed.size, packed.stride, packed.offset)


class _SumGradOverTP:
    """Tensor hook: the gradient summed over the tp group (each rank saw its own tokens)."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        g = grad.clone(memory_format=torch.contiguous_format)  # never reduce autograd's buffer in place
        comm.all_reduce(g, group=self.tp.group, algorithm=self.tp.algorithm)
        return g


# The parameters whose gradients sync_grads_over_tp sums over tp (by identity; an entry goes with its parameter)
_SEQUENCE_PARALLEL: WeakIdKeyDictionary = WeakIdKeyDictionary()


def mark_sequence_parallel(p: torch.Tensor) -> None:
    """Record that ``p`` runs on sequence shards and its gradient is summed over tp (by a hook on it)."""
    _SEQUENCE_PARALLEL[p] = True


def is_sequence_parallel(p: torch.Tensor) -> bool:
    """Whether :func:`sync_grads_over_tp` made ``p``'s gradient a sum over tp (ZeRO-3 cannot keep that hook)."""
    return p in _SEQUENCE_PARALLEL


def sync_grads_over_tp(module: nn.Module, group=None, algorithm: str = "native") -> None:
    """Make every parameter of ``module`` (run on sequence shards) receive the gradient summed over
    the tp group: what the full sequence gives it in one process. Once per module."""
    tp = as_tp_group(group, algorithm)
    if tp.size == 1:
        return
    for p in module.parameters():
        if p.requires_grad and not is_sequence_parallel(p):
            p.register_hook(_SumGradOverTP(tp))
            mark_sequence_parallel(p)


def sequence_parallel_bytes_per_block(b: int, s: int, h: int, P: int, elem_size: int = 4) -> dict[str, int]:
    """Payload of one transformer block per pass under sequence parallelism, in the ledger's
    convention (all_gather: the per-rank tensor, reduce_scatter: the full input). Forward: 2
    all-gathers of b*s*h/P elements and 2 reduce-scatters of b*s*h -- on a ring 4*(P-1)*b*s*h/P
    elements sent, as the 2 all-reduces of plain tensor parallelism. Backward: the mirror image
    (2 reduce-scatters, 2 all-gathers), 2 more all-gathers that rebuild the saved inputs of
    attention and MLP (:class:`RegatherSaved`), and 6 all-reduces of h (the two LayerNorms'
    weight and bias, the two biases after a reduce-scatter). Korthikanti et al. 2022, 4.2.2."""
    shard, full = b * s * h // P * elem_size, b * s * h * elem_size
    return {"all_gather": 2 * shard, "reduce_scatter": 2 * full, "grad_all_reduce": 6 * h * elem_size}
