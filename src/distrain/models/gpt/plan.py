"""The GPT's tensor-parallel plan (Megatron-LM's layout), kept beside the GPT.

``model.py`` knows nothing of parallelism; this file says which of its modules become which
parallel layer (:mod:`distrain.parallel.tensor_parallel.plan`)::

    wte              vocab      rows of the vocabulary, g on the output
    attn             f on the attention's input once, for q, k and v together
    attn.q/k/v_proj  colwise    whole heads per rank (n_head/P), no f of their own
    attn.o_proj      rowwise    g on the output, bias added after it
    mlp.fc           colwise    f on the input
    mlp.proj         rowwise    g on the output
    lm_head          colwise    the logits stay sharded (B, T, V/P); the loss reads the shards
                                (vocab-parallel cross entropy = lm_loss), or gathered for generate

The attention reads its head count from ``q_proj.out_features`` at run time, so splitting
q/k/v by whole heads needs no change to the model. Also here: the GPT's sizes for the one tp size
check (:func:`~distrain.parallel.tensor_parallel.check_tp_divides`, naming n_head, n_embd,
4*n_embd, vocab_size) and the exact list of all-reduces of one step.

Context parallelism (:func:`gpt_cp_plan`, :mod:`distrain.parallel.context_parallel`): the modules
that read the sequence layout are the Embedding (``layers.0``: the learned positions of the
tokens this rank holds) and every attention (``attn``: ring or all-to-all over the cp group)::

    layers.0   wpe(positions of this rank's chunks i and 2N-1-i), the block-size check on N x T
    attn       sequence.attend(q, k, v): ring attention, or the all-to-all (N | n_head per tp rank)
"""

from __future__ import annotations

import torch.nn as nn

from distrain.errors import ConfigError
from distrain.models.gpt.model import Block, CausalSelfAttention, Embedding, Head
from distrain.parallel.context_parallel import CPPlan, check_cp_heads
from distrain.parallel.tensor_parallel import (
    ColwiseParallel, CopyInput, RowwiseParallel, TPPlan, check_tp_divides, vocab_parallel_cross_entropy,
)

__all__ = ["check_gpt_cp", "check_gpt_tp", "check_tp_sizes", "gpt_cp_plan", "gpt_tp_plan", "tp_all_reduces_per_step"]


def check_tp_sizes(tp: int, *, n_head: int | None = None, n_embd: int | None = None,
                   mlp_hidden: int | None = None, vocab_size: int | None = None) -> None:
    """Raise ConfigError naming every GPT size that tp does not divide (pure: no communication).
    A size left None is not checked (a pipeline stage without the embedding has no vocab)."""
    sizes = {name: n for name, n in (("n_head", n_head), ("n_embd", n_embd), ("4*n_embd", mlp_hidden),
                                     ("vocab_size", vocab_size)) if n is not None}
    check_tp_divides(tp, sizes, "the GPT")


def check_gpt_tp(model: nn.Module, tp: int) -> None:
    """The GPT's sizes (of every Block, Embedding and Head in ``model``) against tp."""
    sizes: dict[str, set[int]] = {"n_head": set(), "n_embd": set(), "mlp_hidden": set(), "vocab_size": set()}
    for m in model.modules():
        if isinstance(m, Block) and isinstance(m.attn.q_proj, nn.Linear):
            sizes["n_head"].add(m.attn.q_proj.out_features // m.attn.head_dim)
            sizes["n_embd"].add(m.attn.q_proj.out_features)
            if isinstance(m.mlp.fc, nn.Linear):
                sizes["mlp_hidden"].add(m.mlp.fc.out_features)
        elif isinstance(m, Embedding) and isinstance(m.wte, nn.Embedding):
            sizes["vocab_size"].add(m.wte.num_embeddings)
        elif isinstance(m, Head) and isinstance(m.lm_head, nn.Linear):
            sizes["vocab_size"].add(m.lm_head.out_features)
    check_tp_sizes(tp, **{k: min(v, default=None) for k, v in sizes.items()})
    for k, v in sizes.items():  # GPT blocks are alike; a custom stage with several sizes: check each
        for n in v:
            check_tp_sizes(tp, **{k: n})


def gpt_tp_plan(gather_logits: bool = False, sequence_parallel: bool = False) -> TPPlan:
    """Megatron's plan for :class:`~distrain.models.GPT` (or a pipeline stage of it).

    ``gather_logits=False``: ``model(idx)`` returns this rank's logits shard (B, T, V/P) and the
    plan's loss is the vocab-parallel cross entropy. ``True``: the full logits on every rank
    (evaluation, ``generate``), and the plan has no loss of its own (``lm_loss`` applies).
    ``sequence_parallel=True``: the residual stream between the split linears is sharded along
    the sequence (B, T/P, C): the embedding's output is split (``layers.0``, the Embedding),
    LayerNorms run on shards, q/k/v, fc and lm_head all-gather their input, o_proj and proj
    reduce-scatter their output (:mod:`distrain.parallel.tensor_parallel.sequence`); T must
    then be a multiple of P."""
    sp = sequence_parallel
    heads = ColwiseParallel(sync_input=False)  # the f is the attention's copy_input, once for q/k/v
    layers = {"wte": "vocab", "attn": CopyInput(sequence_parallel=sp), "attn.q_proj": heads, "attn.k_proj": heads,
              "attn.v_proj": heads, "attn.o_proj": RowwiseParallel(sequence_parallel=sp),
              "mlp.fc": ColwiseParallel(sequence_parallel=sp), "mlp.proj": RowwiseParallel(sequence_parallel=sp),
              "lm_head": ColwiseParallel(gather_output=gather_logits, sequence_parallel=sp)}
    if sp:
        layers.update({"layers.0": "split_sequence_output", "ln_1": "sequence_parallel",
                       "ln_2": "sequence_parallel", "ln_f": "sequence_parallel"})
    return TPPlan(layers, loss=None if gather_logits else vocab_parallel_cross_entropy, check=check_gpt_tp,
                  sequence_dim=1)


def tp_all_reduces_per_step(n_layer: int, b: int, s: int, h: int, elem_size: int = 4,
                            embedding: bool = True, head: bool = True) -> dict[str, list[tuple[str, int]]]:
    """Every all-reduce the GPT under :func:`gpt_tp_plan` (or a stage of it) issues in one
    forward+backward, in order: {"forward": [(site, payload bytes), ...], "backward": [...]}.
    With the embedding and the head (the whole model) that is 2*n_layer + 1 + 3 forward and
    2*n_layer + 1 backward."""
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


def check_gpt_cp(model: nn.Module, cp: int, variant: str, tp: int = 1) -> None:
    """The GPT against context parallelism (pure): no attention dropout (each rank would draw its own
    masks over blocks of the sequence), and for the all-to-all, cp dividing the heads each rank
    attends with (the attentions' heads as they are now, divided by ``tp`` when tensor parallelism
    is still to come)."""
    attns = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    drop = sorted({m.dropout for m in attns if m.dropout})
    if drop:
        raise ConfigError(f"context parallelism (cp={cp}) does not support the GPT's attention dropout ({drop[0]}): "
                          f"each rank would draw its own masks over blocks of the sequence; use dropout 0")
    if variant == "all-to-all" and attns:
        check_cp_heads(cp, {"n_head": min(a.n_local_heads for a in attns) // tp}, "the GPT", tp)


def gpt_cp_plan() -> CPPlan:
    """Context parallelism for :class:`~distrain.models.GPT` (or a pipeline stage of it): the
    Embedding's positions and every attention read this rank's part of the sequence."""
    return CPPlan(modules=("layers.0", "attn"), check=check_gpt_cp)
