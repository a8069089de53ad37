"""Compute time of one transformer micro-batch on one device, kernel by kernel (a roofline).

For a micro-batch of ``b`` sequences of ``s`` tokens, split over ``tp`` tensor-parallel and
``cp`` context-parallel devices (T = b·s/cp tokens on each), every block costs:

* **matmuls** (QKV, attention output, the MLP's up and down projections, or a MoE layer's router
  and the k experts each token visits): forward (M, N, K) = (T, out/tp, in) and backward twice
  as many FLOPs (input gradient (T, in, out/tp), weight gradient (in, out/tp, T)). Each runs at
  ``max(2MNK / (peak · gemm_eff · q), bytes / (HBM · mem_eff))``, q being the tile and wave
  quantization of cuBLAS's 256x128 output tiles over the device's SMs (NVIDIA, "Matrix
  Multiplication Background User's Guide", tile and wave quantization; split-K fills the SMs when
  a small output has a long K);
* **attention** (fused, flash): forward 4·b·(s/cp)·(s/2)·(a/tp)·d FLOPs (causal: each query
  sees half the keys on average), backward 2.5x the forward (its five matmuls to the forward's
  two; Dao, FlashAttention-2, 2023), at ``peak · attn_eff``;
* **element-wise** kernels at the HBM bandwidth: per token, the two norms (read, write h),
  the two residual adds (read 2h, write h), the MLP activation (GELU: f in and out; SwiGLU: 2f
  in, f out), rotary embeddings on q and k; backward about 1.5x as many bytes (each op reads
  its input and the output gradient and writes the input gradient), and with biases one more
  read of each linear's output gradient (the bias gradient is its sum over tokens). With tensor parallelism
  and no sequence parallelism the norms and adds run on all T tokens in every tp rank; with
  sequence parallelism on T/tp (Korthikanti et al., "Reducing Activation Recomputation",
  2022);
* **recomputation**: ``full`` runs every block's forward again in backward; ``selective``
  re-runs the attention core's forward only (Korthikanti et al.); ``op`` is torchtitan's
  op-level selective checkpointing (torchtitan/parallelisms/parallelize_llama.py: it saves the
  attention and every other matmul's output, and recomputes the other matmuls and every
  element-wise op).

The output head (matmul to V/tp logits) and the loss (16 bytes per logit: the fp32 cast, the
log-sum-exp, and its gradient) run on the last pipeline stage; the optimizer step (AdamW with
fp32 master weights) reads and writes 30 bytes per parameter held: weights, gradient, two
moments, and the bf16 copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from distrain.costmodel.devices import Device
from distrain.costmodel.shapes import Shape

TILE_M, TILE_N = 256, 128  # cuBLAS's large-matmul output tile (NVIDIA's matmul performance guide)
SPLIT_K_MIN = 512  # split-K runs chunks of at least this many K
OPTIMIZER_BYTES = 30  # AdamW, per parameter held: read p, g, m, v (16), write p, m, v (12), write the bf16 copy (2)
LOSS_BYTES = 16  # per logit: fp32 cast (read 2, write 4), log-sum-exp (read 4), gradient (read 4, write 2)
RECOMPUTE = ("none", "selective", "op", "full")


def gemm_seconds(dev: Device, M: float, N: float, K: float, elem: int = 2) -> float:
    """One (M x K) @ (K x N) matmul: the slower of its FLOPs at the quantized peak and its bytes at HBM speed."""
    M, N, K = max(1, round(M)), max(1, round(N)), max(1, round(K))
    eff = dev.gemm_eff
    if dev.sms > 1:
        tm, tn = math.ceil(M / TILE_M), math.ceil(N / TILE_N)
        tiles = tm * tn
        eff *= (M * N) / (tm * TILE_M * tn * TILE_N)  # tile quantization: partial tiles compute in full
        if tiles < dev.sms:  # split-K: more blocks along K when the output alone cannot fill the SMs
            tiles *= max(1, min(dev.sms // tiles, K // SPLIT_K_MIN))
        eff *= tiles / (math.ceil(tiles / dev.sms) * dev.sms)  # wave quantization
    flops = 2.0 * M * N * K
    return max(flops / (dev.bf16_flops * eff), elem * (M * K + K * N + M * N) / (dev.mem_bw * dev.mem_eff))


def _fwd_bwd(dev: Device, M: float, N: float, K: float, count: float = 1.0) -> tuple[float, float]:
    """(forward, backward) seconds of ``count`` matmuls of forward shape (M, N, K)."""
    return (count * gemm_seconds(dev, M, N, K),
            count * (gemm_seconds(dev, M, K, N) + gemm_seconds(dev, K, N, M)))


@dataclass
class BlockTime:
    """Seconds of one block for one micro-batch on one device, by kind; ``fwd_*`` and ``bwd_*``."""
    fwd_gemm: float = 0.0
    bwd_gemm: float = 0.0
    fwd_attn: float = 0.0
    bwd_attn: float = 0.0
    fwd_elem: float = 0.0
    bwd_elem: float = 0.0

    @property
    def forward(self) -> float:
        return self.fwd_gemm + self.fwd_attn + self.fwd_elem

    @property
    def backward(self) -> float:
        return self.bwd_gemm + self.bwd_attn + self.bwd_elem

    def kinds(self, recompute: str) -> tuple[float, float, float]:
        """(matmul, attention, element-wise) seconds of forward + backward, recomputation included."""
        rc = {"none": (0.0, 0.0, 0.0), "selective": (0.0, self.fwd_attn, 0.0),
              "op": (self.fwd_gemm / 2, 0.0, self.fwd_elem), "full": (self.fwd_gemm, self.fwd_attn, self.fwd_elem)}
        g, a, e = rc[recompute]
        return self.fwd_gemm + self.bwd_gemm + g, self.fwd_attn + self.bwd_attn + a, self.fwd_elem + self.bwd_elem + e

    def with_recompute(self, recompute: str) -> tuple[float, float]:
        """(forward, backward) with the recomputation's extra forward work charged to backward."""
        extra = {"none": 0.0, "selective": self.fwd_attn, "op": self.fwd_gemm / 2 + self.fwd_elem,
                 "full": self.forward}[recompute]
        return self.forward, self.backward + extra


def block_time(shape: Shape, dev: Device, b: int, s: int, tp: int = 1, cp: int = 1, ep: int = 1,
               sp: bool = True, attention: str = "fa2") -> BlockTime:
    """One transformer block, one micro-batch of ``b`` x ``s`` tokens, on one device of the layout."""
    h, d, a, g, f = shape.hidden, shape.d, shape.heads, shape.kv_heads, shape.ffn
    T = b * s / cp
    bt = BlockTime()

    def add(fb):
        bt.fwd_gemm += fb[0]
        bt.bwd_gemm += fb[1]

    add(_fwd_bwd(dev, T, (a + 2 * g) * d / tp, h))  # QKV
    add(_fwd_bwd(dev, T, h, a * d / tp))  # attention output
    up = (2 if shape.gated else 1)
    if shape.moe:
        E, k = shape.experts, shape.top_k
        add(_fwd_bwd(dev, T, E, h))  # router
        per_expert = T * k * ep / E  # tokens each local expert receives (balanced routing)
        local = E / ep
        add(_fwd_bwd(dev, per_expert, up * f, h, local))
        add(_fwd_bwd(dev, per_expert, h, f, local))
        act_tokens, act_width = T * k, f
    else:
        add(_fwd_bwd(dev, T, up * f / tp, h))
        add(_fwd_bwd(dev, T, h, f / tp))
        act_tokens, act_width = T, f / tp
    fwd_flops = 4.0 * b * (s / cp) * (s / 2) * (a / tp) * d
    bt.fwd_attn = fwd_flops / (dev.bf16_flops * dev.attn_eff(attention))
    bt.bwd_attn = 2.5 * bt.fwd_attn
    hw = dev.mem_bw * dev.mem_eff
    t_norm = T / tp if (sp or tp == 1) else T  # tokens the norms and residual adds run on
    rope = 0.0 if shape.positions else 4 * (a + g) * d / tp * T  # read + write q and k (2 bytes each)
    act_f = (6 if shape.gated else 4) * act_width * act_tokens
    act_b = (10 if shape.gated else 6) * act_width * act_tokens
    moe_copy = 8 * h * T * shape.top_k if shape.moe else 0.0  # dispatch and combine: read + write each copy
    bt.fwd_elem = (20 * h * t_norm + act_f + rope + moe_copy) / hw
    # with biases, backward sums each linear's output gradient over the tokens (one more read of it)
    bias = 2 * ((a + 2 * g) * d / tp + 2 * h + up * act_width) * T if shape.bias and not shape.moe else 0.0
    bt.bwd_elem = (24 * h * t_norm + act_b + rope + moe_copy + bias) / hw
    return bt


def head_time(shape: Shape, dev: Device, b: int, s: int, tp: int = 1, cp: int = 1) -> tuple[float, float]:
    """(matmul, element-wise) seconds, forward + backward, of the output head and the loss (last stage)."""
    T = b * s / cp
    fwd, bwd = _fwd_bwd(dev, T, shape.vocab / tp, shape.hidden)
    return fwd + bwd, LOSS_BYTES * T * shape.vocab / tp / (dev.mem_bw * dev.mem_eff)


def optimizer_time(dev: Device, params_held: float) -> float:
    """AdamW over ``params_held`` parameters (a ZeRO shard, or all of a stage's)."""
    return OPTIMIZER_BYTES * params_held / (dev.mem_bw * dev.mem_eff)
