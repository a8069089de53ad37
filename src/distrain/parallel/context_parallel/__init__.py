"""Context parallelism: the sequence split across the N ranks of a cp group, attention across them.

Every layer of a transformer but attention treats tokens independently, so N ranks that hold
the same parameters and each 1/N of every sequence compute exactly what one process computes on
the whole sequence -- except attention, where every query needs every (earlier) key. Two ways to
give it that, both exact (tested in fp64 against one process):

    ring        (ring.py)     Liu et al., "Ring Attention with Blockwise Transformers" (2023): the
                              keys and values go around the ring, N - 1 hops, each block's output
                              merged into the running one by its log-sum-exp (online softmax,
                              Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022); the
                              send of the next block overlaps the current block's compute.
                              Backward passes [k, v] round again and [dk, dv] one step behind.
    all-to-all  (ulysses.py)  Jacobs et al., "DeepSpeed Ulysses" (2023): an all-to-all turns
                              (all heads, T/N tokens) into (h/N heads, all T tokens), attention runs
                              whole, a second all-to-all turns it back. Needs N | heads.

Causal load balancing (load_balance.py; Llama 3, Meta 2024, section 3.3.2): the sequence is cut
into 2N chunks and rank i holds chunks i and 2N-1-i, so every rank does the same attention work
under the causal mask; T % (2N) == 0 is required.

    attention.py  ContextParallel: this rank's positions, ``split`` of the batch, ``attend``
    plan.py       CPPlan (which modules read the layout) and apply_context_parallel; models'
                  plans live beside the models (distrain.models.gpt.plan.gpt_cp_plan)
    sizes.py      check_cp_heads: the all-to-all's rule, one line with the cp values that fit

Contract: every rank of a cp group holds the same parameters (the same tp shard), reads the same
samples of the batch and keeps its 2 chunks of each sequence (``ContextParallel.split`` on inputs
and targets); its loss is the mean over its tokens, and the gradients are averaged over dp x cp
(``Topology.dp_cp_group``), which -- every rank holding T/N tokens -- is the gradient of the mean
over all tokens. Messages go through distrain.comm's ``isend``/``irecv``, so the ledger counts them
(labels ``cp-ring`` and ``cp-all-to-all``); :func:`ring_bytes` and :func:`ulysses_bytes` are the
formulas, checked byte for byte in tests/test_context_parallel.py.
"""

from distrain.parallel.context_parallel.attention import VARIANTS, ContextParallel, check_variant
from distrain.parallel.context_parallel.load_balance import check_length, fitting_sizes, join, positions, split
from distrain.parallel.context_parallel.plan import CPPlan, apply_context_parallel
from distrain.parallel.context_parallel.ring import block_attention, merge, ring_attention, ring_bytes
from distrain.parallel.context_parallel.sizes import check_cp_heads
from distrain.parallel.context_parallel.ulysses import ulysses_attention, ulysses_bytes

__all__ = [
    "CPPlan", "ContextParallel", "VARIANTS", "apply_context_parallel", "block_attention", "check_cp_heads",
    "check_length", "check_variant", "fitting_sizes", "join", "merge", "positions", "ring_attention", "ring_bytes",
    "split", "ulysses_attention", "ulysses_bytes",
]
