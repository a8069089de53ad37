"""The building blocks of tensor parallelism: f/g and the parallel layers.

The contract, the f/g table and the citation are in the package docstring
(:mod:`distrain.parallel.tensor_parallel`); :mod:`.plan` places these layers in a model.

Shapes in comments: B batch, T sequence, C = in_features, O = out_features,
P = tp size, V vocabulary, N = B*T tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.group import TPGroup, as_tp_group, divide_by_tp
from distrain.parallel.tensor_parallel.invariant import chunks_of, column_linear, owner_rows, row_linear
from distrain.parallel.tensor_parallel.sequence import RegatherSaved, gather_from_sequence, reduce_scatter_to_sequence


# ---------------------------------------------------------------------------------------
# f and g (and the gather/scatter pair for layers used at the edges)
# ---------------------------------------------------------------------------------------

class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce (sum) of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)  # never reduce autograd's buffer in place
        comm.all_reduce(grad, group=ctx.tp.group, algorithm=ctx.tp.algorithm)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx, x, tp):
        out = x.clone(memory_format=torch.contiguous_format)  # x may be saved by autograd: reduce a copy
        comm.all_reduce(out, group=tp.group, algorithm=tp.algorithm)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _all_gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    x = x.contiguous()                                               # (..., O/P)
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    comm.all_gather(parts, x, group=tp.group, algorithm=tp.algorithm)
    return torch.cat(parts, dim=-1)                                  # (..., O), rank order


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather_last(x, tp)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.tp.size, dim=-1)[ctx.tp.rank].contiguous(), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last(grad, ctx.tp), None


def _trivial(tp: TPGroup) -> bool:
    return tp.size == 1  # one rank: f, g and the gathers are identities, no collective is issued


def copy_to_tp(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """f: the input of a column-parallel region (identity forward, all-reduce backward)."""
    tp = as_tp_group(group, algorithm)
    return x if _trivial(tp) else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """g: the output of a row-parallel region (all-reduce forward, identity backward)."""
    tp = as_tp_group(group, algorithm)
    return x if _trivial(tp) else _ReduceFromTP.apply(x, tp)


def gather_from_tp(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """(..., O/P) shards -> (..., O) on every rank; backward keeps this rank's slice."""
    tp = as_tp_group(group, algorithm)
    return x if _trivial(tp) else _GatherFromTP.apply(x, tp)


def scatter_to_tp(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """(..., C) replicated -> this rank's (..., C/P) slice; backward all-gathers."""
    tp = as_tp_group(group, algorithm)
    return x if _trivial(tp) else _ScatterToTP.apply(x, tp)


# ---------------------------------------------------------------------------------------
# Parallel layers
# ---------------------------------------------------------------------------------------

class TPModule(nn.Module):
    """Base of every tensor-parallel layer: the group, ``tp_rank``/``tp_size``, and which
    slice each parameter holds."""

    def _setup(self, tp: TPGroup, split: int | None = None, what: str = "") -> None:
        self.tp = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        if tp.chunks and split is not None:  # --layout-invariant: the split dimension in C equal chunks
            divide_by_tp(split, tp.chunks, what)

    def _invariant(self, sequence_parallel: bool = False) -> bool:
        """Whether this layer computes the canonical chunked sums (--layout-invariant)."""
        if not self.tp.chunks:
            return False
        if sequence_parallel:
            raise ConfigError(f"{type(self).__name__}: --layout-invariant does not cover sequence parallelism "
                              f"(its LayerNorm and bias gradients are summed over the ranks' tokens); use a plan "
                              f"without sequence_parallel")
        return True

    def shard_info(self) -> dict[str, tuple[int | None, int, int, tuple[int, ...]]]:
        """{param name: (split dim or None, start, stop, full shape)}; None = replicated."""
        raise NotImplementedError

    def _init_like_linear(self, fan_in: int) -> None:
        # nn.Linear's default init, with the fan-in of the full layer (each shard on its own RNG draw)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        with torch.no_grad():
            self.weight.uniform_(-bound, bound)
            if self.bias is not None:
                self.bias.uniform_(-bound, bound)


class ColumnParallelLinear(TPModule):
    """y = x A^T + b with A (O x C) split by rows (output features): rank r holds
    A[r*O/P:(r+1)*O/P] and the matching bias slice.

    forward: x (..., C) replicated -> f -> (..., O/P) shard, or (..., O) with gather_output.
    ``sync_input=False`` leaves f out, for several column-parallel linears reading one input
    that already went through f once (q, k, v: see apply_tensor_parallel).
    ``sequence_parallel=True``: the input is this rank's sequence shard (B, T/P, C) along
    ``seq_dim``, all-gathered in place of f (reduce-scattered backward; :mod:`.sequence`).
    ``out_features`` is the width of what forward returns (the model's attention reads
    ``q_proj.out_features`` to count its local heads); ``full_out_features`` is O.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 algorithm: str = "native", gather_output: bool = False, sync_input: bool = True,
                 device=None, dtype=None, *, sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        tp = as_tp_group(group, algorithm)
        self._setup(tp, out_features, "out_features")
        self.in_features = in_features
        self.full_out_features = out_features
        self.local_out_features = divide_by_tp(out_features, tp.size, "out_features")
        self.out_features = out_features if gather_output else self.local_out_features
        self.gather_output = gather_output
        self.sync_input = sync_input
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(self.local_out_features, in_features, **kw))  # (O/P, C)
        self.bias = nn.Parameter(torch.empty(self.local_out_features, **kw)) if bias else None  # (O/P,)
        self._init_like_linear(in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, algorithm: str = "native", gather_output: bool = False,
                    sync_input: bool = True, *, sequence_parallel: bool = False,
                    seq_dim: int = 1) -> "ColumnParallelLinear":
        """This rank's row block of a full ``nn.Linear`` (copied: the full layer is untouched;
        no random init is drawn, so the caller's RNG stream is not advanced)."""
        w = linear.weight
        m = nn.utils.skip_init(cls, linear.in_features, linear.out_features, linear.bias is not None, group,
                               algorithm, gather_output, sync_input, device=w.device, dtype=w.dtype,
                               sequence_parallel=sequence_parallel, seq_dim=seq_dim)
        rows = slice(m.tp_rank * m.local_out_features, (m.tp_rank + 1) * m.local_out_features)
        with torch.no_grad():
            m.weight.copy_(w[rows])
            if m.bias is not None:
                m.bias.copy_(linear.bias[rows])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._invariant(self.sequence_parallel):
            if not self.sync_input and not torch.is_grad_enabled():  # no gradient to order (kv-cache decoding)
                y = F.linear(x, self.weight, self.bias)
            else:                                                    # (..., C) per chunk -> (..., O/P)
                y = column_linear(chunks_of(x, self.sync_input, self.tp, "ColumnParallelLinear"), self.weight,
                                  self.bias)
            return gather_from_tp(y, self.tp) if self.gather_output else y
        if self.sync_input and self.sequence_parallel:               # (B, T/P, C) -> (B, T, C)
            full = gather_from_sequence(x, self.tp, dim=self.seq_dim)
            with RegatherSaved(full, x, self.tp, self.seq_dim).hooks:  # keep only the shard for backward
                y = F.linear(full, self.weight, self.bias)           # (B, T, O/P)
            return gather_from_tp(y, self.tp) if self.gather_output else y
        if self.sync_input:
            x = copy_to_tp(x, self.tp)                               # (..., C), f
        y = F.linear(x, self.weight, self.bias)                      # (..., O/P)
        return gather_from_tp(y, self.tp) if self.gather_output else y

    def shard_info(self):
        a, b = self.tp_rank * self.local_out_features, (self.tp_rank + 1) * self.local_out_features
        info = {"weight": (0, a, b, (self.full_out_features, self.in_features))}
        if self.bias is not None:
            info["bias"] = (0, a, b, (self.full_out_features,))
        return info

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.full_out_features} "
                f"(local {self.local_out_features}), bias={self.bias is not None}, "
                f"tp_rank={self.tp_rank} of {self.tp_size}, gather_output={self.gather_output}, "
                f"sync_input={self.sync_input}, sequence_parallel={self.sequence_parallel}, "
                f"algorithm={self.tp.algorithm}")


class RowParallelLinear(TPModule):
    """y = x A^T + b with A (O x C) split by columns (input features): rank r holds
    A[:, r*C/P:(r+1)*C/P]; the bias is whole on every rank and added once, after g.

    forward: x (..., C/P) shard (or (..., C) replicated with input_is_parallel=False, which
    keeps this rank's slice) -> partial (..., O) -> g -> + b -> (..., O) replicated.
    ``sequence_parallel=True``: reduce-scatter along ``seq_dim`` in place of g, so the output is
    this rank's sequence shard (B, T/P, O); the bias then goes through f (its gradient, from
    this rank's tokens only, is summed over the group).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None,
                 algorithm: str = "native", input_is_parallel: bool = True, device=None, dtype=None, *,
                 sequence_parallel: bool = False, seq_dim: int = 1):
        super().__init__()
        tp = as_tp_group(group, algorithm)
        self._setup(tp, in_features, "in_features")
        self.full_in_features = in_features
        self.local_in_features = divide_by_tp(in_features, tp.size, "in_features")
        self.in_features = self.local_in_features if input_is_parallel else in_features
        self.out_features = out_features
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        kw = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in_features, **kw))  # (O, C/P)
        self.bias = nn.Parameter(torch.empty(out_features, **kw)) if bias else None  # (O,) replicated
        self._init_like_linear(in_features)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, algorithm: str = "native",
                    input_is_parallel: bool = True, *, sequence_parallel: bool = False,
                    seq_dim: int = 1) -> "RowParallelLinear":
        """This rank's column block of a full ``nn.Linear``, with the whole bias."""
        w = linear.weight
        m = nn.utils.skip_init(cls, linear.in_features, linear.out_features, linear.bias is not None, group,
                               algorithm, input_is_parallel, device=w.device, dtype=w.dtype,
                               sequence_parallel=sequence_parallel, seq_dim=seq_dim)
        cols = slice(m.tp_rank * m.local_in_features, (m.tp_rank + 1) * m.local_in_features)
        with torch.no_grad():
            m.weight.copy_(w[:, cols])
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.tp)                            # (..., C) -> (..., C/P)
        if self._invariant(self.sequence_parallel):                  # the canonical tree of C chunks
            y = row_linear(x, self.weight, self.tp)                  # (..., O), the same on every rank
            return y + self.bias if self.bias is not None else y
        if self.sequence_parallel:                                   # partial (B, T, O) -> (B, T/P, O)
            y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.tp, dim=self.seq_dim)
            return y + copy_to_tp(self.bias, self.tp) if self.bias is not None else y
        y = reduce_from_tp(F.linear(x, self.weight), self.tp)        # partial (..., O), g
        return y + self.bias if self.bias is not None else y         # bias once, after the sum

    def shard_info(self):
        a, b = self.tp_rank * self.local_in_features, (self.tp_rank + 1) * self.local_in_features
        info = {"weight": (1, a, b, (self.out_features, self.full_in_features))}
        if self.bias is not None:
            info["bias"] = (None, 0, self.out_features, (self.out_features,))
        return info

    def extra_repr(self) -> str:
        return (f"in_features={self.full_in_features} (local {self.local_in_features}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"tp_rank={self.tp_rank} of {self.tp_size}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}, algorithm={self.tp.algorithm}")


class VocabParallelEmbedding(TPModule):
    """Embedding table (V x C) split by rows: rank r holds tokens [r*V/P, (r+1)*V/P).

    forward: ids (...) -> ids outside the range are looked up as row 0 and their output
    zeroed -> partial (..., C) -> g -> (..., C) replicated (each token's row comes from
    exactly one rank). Backward: the masked positions carry zero gradient.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, algorithm: str = "native",
                 device=None, dtype=None):
        super().__init__()
        tp = as_tp_group(group, algorithm)
        self._setup(tp, num_embeddings, "vocab_size")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.local_num_embeddings = divide_by_tp(num_embeddings, tp.size, "vocab_size")
        self.vocab_start = tp.rank * self.local_num_embeddings
        self.vocab_end = self.vocab_start + self.local_num_embeddings
        self.weight = nn.Parameter(torch.empty(self.local_num_embeddings, embedding_dim,
                                               device=device, dtype=dtype))  # (V/P, C)
        with torch.no_grad():
            self.weight.normal_()

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group=None, algorithm: str = "native") -> "VocabParallelEmbedding":
        if emb.padding_idx is not None or emb.max_norm is not None or emb.sparse:
            raise ConfigError("VocabParallelEmbedding.from_embedding: padding_idx, max_norm and sparse are not "
                              "supported; use a plain nn.Embedding")
        w = emb.weight
        m = nn.utils.skip_init(cls, emb.num_embeddings, emb.embedding_dim, group, algorithm, device=w.device,
                               dtype=w.dtype)
        with torch.no_grad():
            m.weight.copy_(w[m.vocab_start:m.vocab_end])
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)            # (...)
        local = (ids - self.vocab_start).masked_fill(outside, 0)                # (...) in [0, V/P)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (..., C) partial
        if self._invariant():  # the owner's rows selected, not added: exact as one process's lookup
            return owner_rows(out, ids, self.local_num_embeddings, self.tp)
        return reduce_from_tp(out, self.tp)                                     # (..., C), g

    def shard_info(self):
        return {"weight": (0, self.vocab_start, self.vocab_end, (self.num_embeddings, self.embedding_dim))}

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, rows [{self.vocab_start}, {self.vocab_end}), "
                f"tp_rank={self.tp_rank} of {self.tp_size}, algorithm={self.tp.algorithm}")


# ---------------------------------------------------------------------------------------
# Communication volume of a transformer block
# ---------------------------------------------------------------------------------------

class BlockAllReduceBytes(NamedTuple):
    forward: int   # g after the attention's row-parallel output + g after the MLP's: 2 x b*s*h elements
    backward: int  # f before the attention's column-parallel inputs + f before the MLP's: 2 x b*s*h


def megatron_bytes_per_block(b: int, s: int, h: int, elem_size: int = 4) -> BlockAllReduceBytes:
    """All-reduce payload of one transformer block for one step (micro-batch b, sequence s,
    hidden h): 2 forward (the g of attention and of the MLP) + 2 backward (their f), each of
    b*s*h elements, independent of the tp size (Megatron-LM, section 3). The bytes each rank
    puts on the wire are the algorithm's: ring 2*(P-1)/P of each payload (distrain.comm.algorithms.cost)."""
    one = b * s * h * elem_size
    return BlockAllReduceBytes(forward=2 * one, backward=2 * one)
