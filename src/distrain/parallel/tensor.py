"""Tensor parallelism: Megatron-LM's intra-layer model parallelism, on distrain.comm.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3. The weights of each linear layer are split across the P
ranks of a tensor-parallel (tp) group, and two conjugate operators keep the math exact:

    op   forward                     backward                     where
    f    identity                    all-reduce(sum) of the grad   input of a column-parallel region
    g    all-reduce(sum)             identity                      output of a row-parallel region

    MLP        x (B,T,C) -f-> fc: column (B,T,4C/P) -> GELU -> proj: row (B,T,C) partial -g-> +b
    attention  x (B,T,C) -f-> q,k,v: column, n_head/P whole heads each (B,T,C/P) -> attention
               on the local heads -> o_proj: row (B,T,C) partial -g-> +b
    embedding  ids (B,T) -> wte: vocab rows [r*V/P,(r+1)*V/P), others zeroed (B,T,C) partial -g->
    LM head    x (B,T,C) -f-> lm_head: column, kept sharded (B,T,V/P) -> vocab-parallel CE
               (3 all-reduces of B*T elements: max, target logit, sum of exp) -> loss

So a transformer block costs exactly 2 all-reduces of B*T*C elements forward (the g after
o_proj and after mlp.proj) and 2 backward (the f before q/k/v, applied once to their shared
input, and the f before mlp.fc): :func:`megatron_bytes_per_block`. q/k/v are three separate
column-parallel linears with ``sync_input=False``; the single f sits in a forward pre-hook on
the attention module, so the three partial input gradients are summed locally by autograd
and all-reduced once (Megatron fuses them into one QKV linear for the same effect).

Contract (as for every collective): every rank of the tp group
  * receives the same input (the same token ids and targets; replicated activations),
  * holds its own shard of the split weights (rank r: row/column/vocab block r of P) and a
    full copy of the replicated ones (LayerNorms, wpe, the biases of row-parallel layers),
  * calls the same collectives in the same order (forward and backward of the same model).
With that, the replicated parameters get identical gradients on every tp rank (f and g make
the activations and their gradients replicated wherever the weights are), so no gradient
all-reduce over the tp group is needed, and a TP model built from the same seeded full
model equals the single-process model step for step (tested in fp64).

The comm algorithm of every f, g and loss all-reduce is selectable ("native", "star", "ring",
"tree"). A tp group of size 1 issues no collective. Dropout: replicated regions must draw the
same masks on every tp rank (seed them alike); the models' default dropout is 0.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.parallel.tensor_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    _TPModule,
    copy_to_tp,
    gather_from_tp,
    reduce_from_tp,
    scatter_to_tp,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "BlockAllReduceBytes", "ColumnParallelLinear", "RowParallelLinear", "ShardInfo", "TPGroup",
    "VocabParallelEmbedding", "apply_tensor_parallel", "check_tp_sizes", "copy_to_tp", "gather_from_tp",
    "megatron_bytes_per_block", "reduce_from_tp", "scatter_to_tp", "tp_all_reduces_per_step", "tp_loss",
    "tp_shard_info", "vocab_parallel_cross_entropy",
]


# ---------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------

def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def check_tp_sizes(tp: int, *, n_head: int | None = None, n_embd: int | None = None,
                   mlp_hidden: int | None = None, vocab_size: int | None = None) -> None:
    """Raise ConfigError naming every size that tp does not divide (pure: no communication).
    A size left None is not checked (a pipeline stage without the embedding has no vocab)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallel: tp must be a positive int, got {tp!r}")
    sizes = [(name, n) for name, n in (("n_head", n_head), ("n_embd", n_embd), ("4*n_embd", mlp_hidden),
                                       ("vocab_size", vocab_size)) if n is not None]
    bad = [f"{name}={n} is not divisible by tp={tp}; choose tp among the divisors of {n}: {_divisors(n)}"
           for name, n in sizes if n % tp]
    if bad:
        msg = "tensor parallelism does not fit the model: " + ". ".join(bad)
        if len(bad) > 1 or len(sizes) > 1:
            fit = [d for d in range(1, min(n for _, n in sizes) + 1) if all(n % d == 0 for _, n in sizes)]
            msg += f". (tp values that divide every size: {', '.join(map(str, fit))})"
        raise ConfigError(msg)


def _find(model: nn.Module):
    from distrain.models.gpt import Block, Embedding, Head

    embs = [m for m in model.modules() if isinstance(m, Embedding)]
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    heads = [m for m in model.modules() if isinstance(m, Head)]
    if not (embs or blocks or heads):
        raise ConfigError(f"apply_tensor_parallel: {type(model).__name__} has no GPT Embedding, Block or Head; "
                          f"tensor parallelism applies to distrain.models.GPT (or a pipeline stage of one)")
    linears = [(f"block.attn.{n}", getattr(b.attn, n)) for b in blocks for n in ("q_proj", "k_proj", "v_proj",
                                                                                  "o_proj")]
    linears += [(f"block.mlp.{n}", getattr(b.mlp, n)) for b in blocks for n in ("fc", "proj")]
    linears += [("head.lm_head", h.lm_head) for h in heads]
    for e in embs:
        if isinstance(e.wte, nn.Embedding) and (e.wte.padding_idx is not None or e.wte.max_norm is not None
                                                or e.wte.sparse):
            raise ConfigError("apply_tensor_parallel: embedding.wte with padding_idx, max_norm or sparse=True "
                              "is not supported by VocabParallelEmbedding")
    for what, m in linears + [("embedding.wte", e.wte) for e in embs]:
        if isinstance(m, _TPModule):
            raise ConfigError(f"apply_tensor_parallel: {what} is already tensor-parallel; apply it once, "
                              f"to a model built whole")
        if not isinstance(m, (nn.Linear, nn.Embedding)):
            raise ConfigError(f"apply_tensor_parallel: {what} is a {type(m).__name__}, expected nn.Linear / "
                              f"nn.Embedding")
    return embs, blocks, heads


# ---------------------------------------------------------------------------------------
# Applying it to the GPT
# ---------------------------------------------------------------------------------------

class _CopyInputHook:
    """Forward pre-hook on an attention module: f on its input, once for q, k and v."""

    def __init__(self, tp: TPGroup):
        self.tp = tp

    def __call__(self, module, args):
        return (copy_to_tp(args[0], self.tp),) + tuple(args[1:])


def apply_tensor_parallel(model: nn.Module, group=None, algorithm: str = "native", *,
                          gather_logits: bool = False) -> nn.Module:
    """Split ``model`` (a GPT, or a pipeline stage holding some of its layers) over the tp
    ``group`` in place and return it. Every rank must pass the same full model (same seed).

    wte -> VocabParallelEmbedding; per Block q/k/v -> ColumnParallelLinear (head blocks,
    one f for the three), o_proj -> RowParallelLinear, mlp.fc -> column, mlp.proj -> row;
    lm_head -> column with the output kept sharded: ``model(idx)`` then returns this rank's
    logits shard (B, T, V/P), for :func:`tp_loss`. ``gather_logits=True`` all-gathers the
    full logits instead (for evaluation and ``generate``). LayerNorms and wpe stay whole.
    Every size is checked before anything changes or any collective runs.
    """
    tp = TPGroup(group, algorithm)  # checks the algorithm and that this rank is in the group
    embs, blocks, heads = _find(model)
    sizes: dict[str, set[int]] = {"n_head": set(), "n_embd": set(), "mlp_hidden": set(), "vocab_size": set()}
    for b in blocks:
        sizes["n_head"].add(b.attn.q_proj.out_features // b.attn.head_dim)
        sizes["n_embd"].add(b.attn.q_proj.out_features)
        sizes["mlp_hidden"].add(b.mlp.fc.out_features)
    sizes["vocab_size"].update([e.wte.num_embeddings for e in embs] + [h.lm_head.out_features for h in heads])
    check_tp_sizes(tp.size, **{k: min(v, default=None) for k, v in sizes.items()})
    for k, v in sizes.items():  # GPT blocks are alike; a custom stage with several sizes: check each
        for n in v:
            check_tp_sizes(tp.size, **{k: n})
    # Everything is valid: replace the modules (setattr on their parents).
    for e in embs:
        e.wte = VocabParallelEmbedding.from_embedding(e.wte, tp)
    for b in blocks:
        a = b.attn
        for name in ("q_proj", "k_proj", "v_proj"):
            setattr(a, name, ColumnParallelLinear.from_linear(getattr(a, name), tp, sync_input=False))
        a.o_proj = RowParallelLinear.from_linear(a.o_proj, tp)
        a.register_forward_pre_hook(_CopyInputHook(tp))
        b.mlp.fc = ColumnParallelLinear.from_linear(b.mlp.fc, tp)
        b.mlp.proj = RowParallelLinear.from_linear(b.mlp.proj, tp)
    for h in heads:
        h.lm_head = ColumnParallelLinear.from_linear(h.lm_head, tp, gather_output=gather_logits)
    return model


def tp_loss(logits_shard: torch.Tensor, targets: torch.Tensor, group=None, algorithm: str = "native",
            ignore_index: int = -100) -> torch.Tensor:
    """The training loss of a tensor-parallel GPT: :func:`vocab_parallel_cross_entropy` of
    ``model(idx)``'s logits shard. The value is the full model's ``lm_loss``, identical on
    every tp rank: log it from any one of them (no extra communication)."""
    return vocab_parallel_cross_entropy(logits_shard, targets, group, algorithm, ignore_index)


# ---------------------------------------------------------------------------------------
# Which slice each rank holds (for checkpoints)
# ---------------------------------------------------------------------------------------

class ShardInfo(NamedTuple):
    """Where a parameter of a tp rank sits in the full one. ``dim`` None: replicated."""
    dim: int | None
    start: int
    stop: int
    full_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor (a view)."""
        if tuple(full.shape) != tuple(self.full_shape):
            raise ConfigError(f"ShardInfo.take: full tensor has shape {tuple(full.shape)}, expected "
                              f"{tuple(self.full_shape)}")
        return full if self.dim is None else full.narrow(self.dim, self.start, self.stop - self.start)


def tp_shard_info(model: nn.Module) -> dict[str, ShardInfo]:
    """{parameter name (as in ``model.named_parameters()``): ShardInfo} for every parameter.
    A checkpoint of a tp rank stores it next to the shards; ``info.take(full)`` slices a
    full tensor (from a single-process checkpoint) into this rank's shard."""
    sharded: dict[str, ShardInfo] = {}
    rank, size = 0, 1  # a model without tensor parallelism: everything is whole
    for mname, m in model.named_modules():
        if isinstance(m, _TPModule):
            rank, size = m.tp_rank, m.tp_size
            for pname, (dim, a, b, shape) in m.shard_info().items():
                sharded[f"{mname}.{pname}" if mname else pname] = ShardInfo(dim, a, b, tuple(shape), rank, size)
    return {name: sharded.get(name) or ShardInfo(None, 0, p.shape[0] if p.dim() else 1, tuple(p.shape), rank, size)
            for name, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------
# Communication volume
# ---------------------------------------------------------------------------------------

class BlockAllReduceBytes(NamedTuple):
    forward: int   # g after attn.o_proj + g after mlp.proj: 2 all-reduces of b*s*h elements
    backward: int  # f before attn q/k/v + f before mlp.fc:  2 all-reduces of b*s*h elements


def megatron_bytes_per_block(b: int, s: int, h: int, elem_size: int = 4) -> BlockAllReduceBytes:
    """All-reduce payload of one transformer block for one step (micro-batch b, sequence s,
    hidden h): 2 forward (the g of attention and of the MLP) + 2 backward (their f), each of
    b*s*h elements, independent of the tp size. The bytes each rank puts on the wire are
    the algorithm's: ring 2*(P-1)/P of each payload (distrain.comm.cost.traffic)."""
    one = b * s * h * elem_size
    return BlockAllReduceBytes(forward=2 * one, backward=2 * one)


def tp_all_reduces_per_step(n_layer: int, b: int, s: int, h: int, elem_size: int = 4,
                            embedding: bool = True, head: bool = True) -> dict[str, list[tuple[str, int]]]:
    """Every all-reduce a tensor-parallel GPT (or stage) issues in one forward+backward, in
    order: {"forward": [(site, payload bytes), ...], "backward": [...]}. With the embedding
    and the head (the whole model) that is 2*n_layer + 1 + 3 forward and 2*n_layer + 1 backward.
    """
    act, tok = b * s * h * elem_size, b * s * elem_size
    fwd = [("embedding.wte g", act)] if embedding else []
    bwd = [("head.lm_head f", act)] if head else []
    for i in range(n_layer):
        fwd += [(f"block{i}.attn g", act), (f"block{i}.mlp g", act)]
    for i in reversed(range(n_layer)):
        bwd += [(f"block{i}.mlp f", act), (f"block{i}.attn f", act)]
    if head:
        fwd += [("loss max", tok), ("loss target logit", tok), ("loss sum exp", tok)]
    return {"forward": fwd, "backward": bwd}
