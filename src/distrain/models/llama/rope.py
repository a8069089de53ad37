"""Rotary position embeddings (RoPE) in Hugging Face's "rotate_half" layout.

Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding" (2021), eq. 34:
each pair of channels of a query/key head is rotated by the angle ``m * theta_i`` of its
position m, with ``theta_i = base^(-2i/d)`` for i in [0, d/2) (d = head_dim).

Layout: HF pairs channel i with channel i + d/2 (not 2i with 2i+1 as Meta's original code
does), so ``x_rot = x * cos + rotate_half(x) * sin`` with ``rotate_half([a, b]) = [-b, a]``
and ``cos = [cos(m theta), cos(m theta)]`` (d channels). Our wq/wk rows are therefore in HF's
order and HF weights load without the permutation torchtitan applies to Meta checkpoints.

Llama 3 frequency scaling (HF ``rope_type="llama3"``; Meta, "The Llama 3 Herd of Models",
2024, and its reference code): with L = original_max_position_embeddings and wavelength
``w_i = 2 pi / theta_i``, frequencies whose wavelength is shorter than L / high_freq_factor
are kept, those longer than L / low_freq_factor are divided by ``factor``, and those between
are interpolated with ``s = (L / w_i - low) / (high - low)``:
``theta_i' = (1 - s) * theta_i / factor + s * theta_i``.
"""

from __future__ import annotations

import math

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def inv_frequencies(head_dim: int, base: float, scaling: dict | None = None) -> torch.Tensor:
    """``theta_i`` for i in [0, head_dim/2), float32 (computed as HF does, so the same bits),
    with the Llama 3 scaling applied when ``scaling`` is given. Shape (head_dim/2,), on the default device.
    Computed on the CPU whatever the default device (the same bits on every device; on the meta device,
    PyTorch's Python references of these ops would import torch._dynamo: models/meta.py)."""
    return _inv_frequencies(head_dim, base, scaling).to(torch.get_default_device())


def _inv_frequencies(head_dim: int, base: float, scaling: dict | None) -> torch.Tensor:
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim  # (d/2,)
    inv = 1.0 / (base ** exps)                                                            # (d/2,)
    if not scaling:
        return inv
    factor, low, high = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv                                                           # (d/2,)
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)                      # long waves: / factor
    smooth = (old_len / wavelen - low) / (high - low)                                     # (d/2,)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: int | torch.Tensor,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles ``m * theta_i`` for positions m in [0, T) (``positions`` an int T),
    or for the given positions (a (T,) int tensor: a context-parallel rank's tokens), each (T,
    head_dim), in ``dtype``. Angles are computed in float32 (as HF does) unless the model runs in
    float64."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    if isinstance(positions, int):
        positions = torch.arange(positions, device=inv_freq.device)
    pos = positions.to(device=inv_freq.device, dtype=work)                                # (T,)
    freqs = pos[:, None] * inv_freq.to(work)[None, :]                                     # (T, d/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                               # (T, d)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[a, b] -> [-b, a] on the last dim (a, b its halves)."""
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, h, T, d) by the angles of its positions: cos/sin (T, d)."""
    return x * cos + rotate_half(x) * sin
