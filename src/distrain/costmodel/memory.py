"""Bytes per device of a transformer training layout: states, activations, buffers.

States (mixed precision with AdamW, the Megatron-LM and FSDP default): per parameter a device
holds a bf16 working copy (2 bytes), an fp32 gradient (4), and fp32 master weights and two
moments (12). ZeRO (Rajbhandari et al., SC 2020) shards them over the data-parallel group
(dp x cp ranks): stage 1 the master weights and moments, stage 2 also the gradients, stage 3
(FSDP) also the working copy, which it gathers one block at a time (two blocks' worth held: the
one computing and the one prefetched). A device holds the parameters of its pipeline stage
(the larger of the first stage's embedding and the last stage's head), cut by tensor
parallelism; a MoE layer's experts are cut by expert parallelism instead.

Activations kept for backward per block and token (bf16, 2 bytes each): the block input and
the two norms' outputs and the MLP input (4h: cut by tp only with sequence parallelism), q, k,
v and the attention output ((2a + 2g)·d / tp; fused attention keeps no s x s scores), the MLP's
up projection and activation output ((gated ? 3 : 2)·f / tp). Korthikanti et al. (2022) count
the same tensors for GPT (their 34·s·b·h less dropout masks and the s^2 terms fused attention
removes). With full recomputation only the block input stays, plus one block being recomputed; with
torchtitan's op-level selective recomputation (``op``) the middle of the two.
A 1F1B pipeline's first stage holds min(m, pp) micro-batches (interleaved with v chunks:
x (1 + (pp-1)/(pp·v)), Narayanan et al. 2021), and the last stage the fp32 and bf16 logits of one
micro-batch (6 bytes per logit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distrain.costmodel.shapes import Shape

WEIGHT, GRAD, OPT = 2, 4, 12  # bytes per parameter: bf16 weights, fp32 gradient, fp32 master + two moments


@dataclass
class Memory:
    states: float
    activations: float
    buffers: float

    @property
    def total(self) -> float:
        return self.states + self.activations + self.buffers


def stage_params(shape: Shape, tp: int, pp: int, ep: int) -> tuple[float, float]:
    """(dense, expert) parameters one device holds: its stage's blocks cut by tp (experts by ep),
    plus the embedding or the head (whichever is larger) on an end stage."""
    per_stage = math.ceil(shape.layers / pp)
    experts = shape.expert_params_per_layer()
    dense_layer = shape.layer_params() - experts
    ends = max(shape.embedding_params(), shape.head_params()) if pp > 1 else \
        shape.embedding_params() + shape.head_params()
    return per_stage * dense_layer / tp + ends / tp, per_stage * experts / ep


def block_activation_bytes(shape: Shape, tokens: float, tp: int, sp: bool, recompute: str) -> float:
    """Bytes one block keeps for backward for ``tokens`` tokens on one device."""
    h, d, a, g, f = shape.hidden, shape.d, shape.heads, shape.kv_heads, shape.ffn
    cut = tp if (sp or tp == 1) else 1
    if recompute == "full":
        return 2.0 * h * tokens / cut
    if recompute == "op":  # about half of the matmul outputs saved: between none and full
        return (block_activation_bytes(shape, tokens, tp, sp, "none") + 2.0 * h * tokens / cut) / 2
    k = shape.top_k if shape.moe else 1
    mlp = (3 if shape.gated else 2) * f * k / (1 if shape.moe else tp) + (h * k if shape.moe else 0)
    return 2.0 * tokens * (4 * h / cut + (2 * a + 2 * g) * d / tp + mlp)


def memory(shape: Shape, *, tp: int, pp: int, cp: int, dp: int, ep: int, zero: int, micro_batch: int, seq: int,
           microbatches: int, recompute: str, sp: bool = True, vpp: int = 1) -> Memory:
    dense, expert = stage_params(shape, tp, pp, ep)
    D = dp * cp  # the group a gradient is reduced over
    De = max(1, D * tp // ep)  # an expert's replicas (experts are cut by ep, not tp)
    states = 0.0
    for n, group in ((dense, D), (expert, De)):
        states += n * (WEIGHT / (group if zero >= 3 else 1) + GRAD / (group if zero >= 2 else 1)
                       + OPT / (group if zero >= 1 else 1))
    tokens = micro_batch * seq / cp
    per_block = block_activation_bytes(shape, tokens, tp, sp, recompute)
    layers = math.ceil(shape.layers / pp)
    in_flight = min(microbatches, pp) * ((1 + (pp - 1) / (pp * vpp)) if vpp > 1 else 1)
    acts = layers * per_block * in_flight
    if recompute == "full":  # the block being recomputed holds its full activations
        acts += block_activation_bytes(shape, tokens, tp, sp, "none")
    logits = 6.0 * tokens * shape.vocab / tp
    buffers = logits
    if zero >= 3:  # two blocks gathered: the one computing, the one prefetched
        buffers += 2 * WEIGHT * (shape.layer_params() - shape.expert_params_per_layer()) / tp
    return Memory(states, acts, buffers)
