"""The Llama's tensor-parallel plan (Megatron-LM's layout, with grouped-query attention).

``model.py`` knows nothing of parallelism; this file says which of its modules become which
parallel layer (:mod:`distrain.parallel.tensor_parallel.plan`), as ``models/gpt/plan.py`` does for the GPT::

    tok_embeddings          vocab      rows of the vocabulary, g on the output
    attention               f on the attention's input once, for wq, wk and wv together
    attention.wq            colwise    whole query heads per rank: n_head/P
    attention.wk / wv       colwise    whole key/value heads per rank: n_kv_head/P
    attention.wo            rowwise    g on the output (no bias)
    feed_forward            f on the MLP's input once, for w1 and w3 together
    feed_forward.w1 / w3    colwise    gate and up: intermediate_size/P columns each
    feed_forward.w2         rowwise    down: g on the output
    output                  colwise    logits stay sharded (B, T, V/P): vocab-parallel cross entropy
    tied_output             f on its input; it reads the vocab-parallel embedding's own rows,
                                       so its logits are the same (B, T, V/P) shard

Grouped-query attention under TP: query head h uses kv head h // r (r = n_head / n_kv_head), so
rank p's query heads [p*n_head/P, (p+1)*n_head/P) use exactly kv heads [p*n_kv_head/P,
(p+1)*n_kv_head/P): contiguous column blocks of wq and of wk/wv line up, and the attention,
which counts its local heads from ``wq.out_features`` and ``wk.out_features``, needs no change.
That requires P to divide n_kv_head (replicating kv heads when P > n_kv_head is not done):
:func:`check_llama_tp_sizes` refuses other tp values before anything changes.

Sequence parallel (Korthikanti et al. 2022): the RMSNorms run on sequence shards, the embedding's
output is split, and the f/g above become all-gathers / reduce-scatters, as in the GPT's plan.
A block costs 2 all-reduces of B*T*C forward and 2 backward, as the GPT's.

Context parallelism (:func:`llama_cp_plan`, :mod:`distrain.parallel.context_parallel`): the
embedding (``layers.0``: the block-size check on the whole sequence) and every attention
(``attention``: RoPE at the global positions of this rank's chunks i and 2N-1-i, then ring
attention or the all-to-all; the ring passes the n_kv_head key/value heads, not the expanded
ones; the all-to-all needs cp | n_head and cp | n_kv_head per tp rank).

Expert parallelism (:func:`llama_ep_plan`, :mod:`distrain.parallel.expert_parallel`): a Llama with
``moe`` has a mixture of experts as every block's ``feed_forward``; each ep rank keeps E/ep of its
experts. The tensor-parallel plan above does not split experts (tp with ``moe`` is refused).
"""

from __future__ import annotations

import torch.nn as nn

from distrain.errors import ConfigError
from distrain.models.llama.model import Attention, FeedForward, LlamaEmbedding, LlamaHead
from distrain.parallel.context_parallel import CPPlan, check_cp_heads
from distrain.parallel.expert_parallel import EPPlan
from distrain.parallel.tensor_parallel import (
    ColwiseParallel, CopyInput, RowwiseParallel, TPPlan, check_tp_divides, vocab_parallel_cross_entropy,
)

__all__ = ["check_llama_cp", "check_llama_tp", "check_llama_tp_sizes", "llama_cp_plan", "llama_ep_plan",
           "llama_tp_plan"]

_RULES = {
    "n_head": "every rank holds whole query heads",
    "n_kv_head": "grouped-query attention: every rank holds whole key/value heads, the ones its query heads use",
    "intermediate_size": "w1/w3 columns and w2 rows are split",
    "vocab_size": "the embedding's rows and the head's logits are split",
}


def check_llama_tp_sizes(tp: int, *, n_head: int | None = None, n_kv_head: int | None = None,
                         intermediate_size: int | None = None, vocab_size: int | None = None) -> None:
    """Raise ConfigError naming every Llama size that tp does not divide, the rule behind it and
    the tp values that fit (pure: no communication). A size left None is not checked."""
    sizes = {k: v for k, v in dict(n_head=n_head, n_kv_head=n_kv_head, intermediate_size=intermediate_size,
                                   vocab_size=vocab_size).items() if v is not None}
    check_tp_divides(tp, sizes, "the Llama", rules=_RULES)


def _sizes(model: nn.Module) -> dict[str, set[int]]:
    sizes: dict[str, set[int]] = {k: set() for k in _RULES}
    for m in model.modules():
        if isinstance(m, Attention) and isinstance(m.wq, nn.Linear) and isinstance(m.wk, nn.Linear):
            sizes["n_head"].add(m.wq.out_features // m.head_dim)
            sizes["n_kv_head"].add(m.wk.out_features // m.head_dim)
        elif isinstance(m, FeedForward) and isinstance(m.w1, nn.Linear):
            sizes["intermediate_size"].add(m.w1.out_features)
        elif isinstance(m, LlamaEmbedding) and isinstance(m.tok_embeddings, nn.Embedding):
            sizes["vocab_size"].add(m.tok_embeddings.num_embeddings)
        elif isinstance(m, LlamaHead) and isinstance(getattr(m, "output", None), nn.Linear):
            sizes["vocab_size"].add(m.output.out_features)
    return sizes


def check_llama_tp(model: nn.Module, tp: int, gather_logits: bool = False) -> None:
    """The sizes of every Llama part in ``model`` (a whole Llama or a pipeline stage) against tp."""
    sizes = _sizes(model)
    check_llama_tp_sizes(tp, **{k: min(v, default=None) for k, v in sizes.items()})
    for k, v in sizes.items():  # blocks are alike; a custom stage with several sizes: check each
        for n in v:
            check_llama_tp_sizes(tp, **{k: n})
    if gather_logits and tp > 1 and any(isinstance(m, LlamaHead) and hasattr(m, "tied_output")
                                        for m in model.modules()):
        raise ConfigError("llama_tp_plan(gather_logits=True) gathers the logits of an nn.Linear head; this Llama's "
                          "head is tied to the embedding (tie_word_embeddings=True): use gather_logits=False "
                          "(sharded logits, vocab-parallel loss) or an untied model")


def llama_tp_plan(gather_logits: bool = False, sequence_parallel: bool = False) -> TPPlan:
    """Megatron's plan for :class:`~distrain.models.llama.Llama` (or a pipeline stage of it).

    ``gather_logits=False``: ``model(idx)`` returns this rank's logits shard (B, T, V/P) and the
    plan's loss is the vocab-parallel cross entropy; ``True`` (untied heads only): full logits on
    every rank and no loss of the plan's own. ``sequence_parallel=True``: RMSNorms and residual
    stream on sequence shards (B, T/P, C); T must then be a multiple of P."""
    sp = sequence_parallel
    heads = ColwiseParallel(sync_input=False)  # the f (or all-gather) is the parent's CopyInput, once
    layers = {"tok_embeddings": "vocab",
              "attention": CopyInput(sequence_parallel=sp), "attention.wq": heads, "attention.wk": heads,
              "attention.wv": heads, "attention.wo": RowwiseParallel(sequence_parallel=sp),
              "feed_forward": CopyInput(sequence_parallel=sp), "feed_forward.w1": heads, "feed_forward.w3": heads,
              "feed_forward.w2": RowwiseParallel(sequence_parallel=sp),
              "output": ColwiseParallel(gather_output=gather_logits, sequence_parallel=sp),
              "tied_output": CopyInput(sequence_parallel=sp)}
    if sp:
        layers.update({"layers.0": "split_sequence_output", "attention_norm": "sequence_parallel",
                       "ffn_norm": "sequence_parallel", "norm": "sequence_parallel"})
    return TPPlan(layers, loss=None if gather_logits else vocab_parallel_cross_entropy,
                  check=lambda model, tp: check_llama_tp(model, tp, gather_logits), sequence_dim=1)


def check_llama_cp(model: nn.Module, cp: int, variant: str, tp: int = 1) -> None:
    """The Llama against context parallelism (pure): for the all-to-all, cp divides the query and the
    key/value heads each rank attends with (as the attentions hold them now, divided by ``tp`` when
    tensor parallelism is still to come). The ring takes any head count."""
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    if variant == "all-to-all" and attns:
        check_cp_heads(cp, {"n_head": min(a.n_local_heads for a in attns) // tp,
                            "n_kv_head": min(a.n_local_kv_heads for a in attns) // tp}, "the Llama", tp)


def llama_cp_plan() -> CPPlan:
    """Context parallelism for :class:`~distrain.models.llama.Llama` (or a pipeline stage of it)."""
    return CPPlan(modules=("layers.0", "attention"), check=check_llama_cp)


def llama_ep_plan() -> EPPlan:
    """Expert parallelism for a Llama with ``moe`` (:mod:`distrain.models.moe`): every block's
    ``feed_forward`` is a mixture layer whose experts split across the ep ranks."""
    return EPPlan(modules=("feed_forward",))
