"""Tensor parallelism: Megatron-LM's intra-layer model parallelism, on distrain.comm.

Shoeybi et al., "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (2019), section 3. Seed ``001`` "Tensor Parallelism (TP)" shows the idea in
six lines: ``act(x @ w1) @ w2 == act(x @ w11) @ w21 + act(x @ w12) @ w22`` with ``w1`` split
by columns (*column parallel*: each rank computes its own slice of the hidden units) and
``w2`` by rows (*row parallel*: each rank a partial sum, added by an all-reduce). Two
conjugate operators keep forward and backward exact on P ranks of a tp group:

    op   forward                     backward                     where
    f    identity                    all-reduce(sum) of the grad   input of a column-parallel region
    g    all-reduce(sum)             identity                      output of a row-parallel region

    MLP        x (B,T,C) -f-> fc: column (B,T,4C/P) -> GELU -> proj: row (B,T,C) partial -g-> +b
    attention  x (B,T,C) -f-> q,k,v: column, n_head/P whole heads each (B,T,C/P) -> attention
               on the local heads -> o_proj: row (B,T,C) partial -g-> +b
    embedding  ids (B,T) -> wte: vocab rows [r*V/P,(r+1)*V/P), others zeroed (B,T,C) partial -g->
    LM head    x (B,T,C) -f-> lm_head: column, kept sharded (B,T,V/P) -> vocab-parallel CE
               (3 all-reduces of B*T elements: max, target logit, sum of exp) -> loss

So a transformer block costs 2 all-reduces of B*T*C elements forward and 2 backward
(:func:`megatron_bytes_per_block`), whatever P is.

    layers.py  f and g (copy_to_tp, reduce_from_tp; gather/scatter for the edges) and the
               parallel layers (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    sequence.py  sequence parallelism (Korthikanti et al. 2022): LayerNorm/dropout regions
               sharded along the sequence; all-gather and reduce-scatter in place of f and g
    loss.py    vocab_parallel_cross_entropy: the loss of vocab-sharded logits
    group.py   TPGroup: the group, the algorithm and this rank's place, shared by the layers
    plan.py    TPPlan: module name -> "colwise" / "rowwise" / "vocab" / "copy_input", and
               apply_tensor_parallel(model, group, algorithm, plan=...); tp_shard_info for
               checkpoints. Models' plans live beside the models (distrain.models.gpt.plan).
    sizes.py   check_tp_divides(tp, {name: size}, what): the one size check every plan calls
               (and divisors(n)); pure

Contract (as for every collective): every rank of the tp group receives the same input,
holds its own shard of the planned weights and a full copy of the rest (LayerNorms, position
embeddings, row-parallel biases), and calls the same collectives in the same order. Then the
replicated parameters get identical gradients on every tp rank, no gradient all-reduce over
the tp group is needed, and the TP model equals the single-process one step for step
(tested in fp64). Every f, g and loss all-reduce uses the group's algorithm ("native",
"star", "ring", "tree"); a group of one rank issues no collective. Dropout inside a
replicated region must draw the same mask on every tp rank (seed them alike).
"""

from distrain.parallel.tensor_parallel.layers import (
    BlockAllReduceBytes,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    TPModule,
    VocabParallelEmbedding,
    copy_to_tp,
    gather_from_tp,
    megatron_bytes_per_block,
    reduce_from_tp,
    scatter_to_tp,
)
from distrain.parallel.tensor_parallel.loss import vocab_parallel_cross_entropy
from distrain.parallel.tensor_parallel.plan import (
    ColwiseParallel,
    CopyInput,
    RowwiseParallel,
    ShardInfo,
    TPPlan,
    SequenceParallel,
    SplitSequenceOutput,
    VocabParallel,
    apply_tensor_parallel,
    tp_shard_info,
)
from distrain.parallel.tensor_parallel.sizes import check_tp_divides, divisors
from distrain.parallel.tensor_parallel.sequence import (
    gather_from_sequence,
    is_sequence_parallel,
    reduce_scatter_to_sequence,
    sequence_parallel_bytes_per_block,
    split_to_sequence,
    sync_grads_over_tp,
)

tp_loss = vocab_parallel_cross_entropy  # the training loss of a plan that keeps the logits sharded

__all__ = [
    "BlockAllReduceBytes", "ColumnParallelLinear", "ColwiseParallel", "CopyInput", "RowParallelLinear",
    "RowwiseParallel", "SequenceParallel", "ShardInfo", "SplitSequenceOutput", "TPGroup", "TPModule", "TPPlan",
    "VocabParallel", "VocabParallelEmbedding", "apply_tensor_parallel", "check_tp_divides", "copy_to_tp",
    "divisors", "gather_from_sequence", "is_sequence_parallel",
    "gather_from_tp", "megatron_bytes_per_block", "reduce_from_tp", "reduce_scatter_to_sequence", "scatter_to_tp",
    "sequence_parallel_bytes_per_block", "split_to_sequence", "sync_grads_over_tp", "tp_loss", "tp_shard_info",
    "vocab_parallel_cross_entropy",
]
