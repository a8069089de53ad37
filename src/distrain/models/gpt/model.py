"""A small GPT (decoder-only transformer) laid out for pipeline and tensor parallelism.

Layout contract (other parts of distrain rely on it; keep it when editing):

* ``GPT.layers = nn.ModuleList([Embedding, Block, ..., Block, Head])`` and
  ``GPT.forward`` is exactly ``for layer in self.layers: x = layer(x)``; a
  pipeline stage is a contiguous slice of ``layers``.
  Embedding: ids ``(B, T)`` -> ``(B, T, C)``; Block: ``(B, T, C)`` -> ``(B, T, C)``;
  Head: ``(B, T, C)`` -> logits ``(B, T, V)``. The loss is :func:`lm_loss`, outside.
* ``Embedding.wte`` (V x C), ``Embedding.wpe`` (block_size x C);
  ``Block.ln_1, attn, ln_2, mlp``; ``CausalSelfAttention.q_proj/k_proj/v_proj/o_proj``
  (nn.Linear C->C with bias); ``MLPBlock.fc`` (C->4C) and ``MLPBlock.proj`` (4C->C);
  ``Head.ln_f`` and ``Head.lm_head`` (C->V, no bias).
* Attention reads its head count from the weights at run time:
  ``n_local_heads = q_proj.out_features // head_dim``; so q/k/v may be replaced by
  column-parallel linears holding a subset of heads (and o_proj by a row-parallel
  one) without touching this file. Same for the MLP: nothing assumes fc's width.
* ``Embedding.sequence`` and ``CausalSelfAttention.sequence`` (``models/sequence.py``): the
  positions of the tokens the module holds and the attention over the whole sequence; the
  one-process ``WHOLE`` unless a context-parallel plan (``plan.py`` ``gpt_cp_plan``) set this
  rank's part of the sequence on the instance. The model's code is the same either way.
* Incremental decoding (one process, inference): ``GPT.new_cache()`` and
  ``GPT.forward_cached(idx, cache)`` (:mod:`distrain.models.kv_cache`) run only the new tokens, at
  the positions after the cached ones, each block reading and extending its stored keys/values.
  ``forward`` (training, every parallel layout) does not touch a cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.kv_cache import CachedDecoding, KVCache, attend_cached, check_whole
from distrain.models.outputs import logits_of
from distrain.models.sampling import generate  # noqa: F401 (re-exported: distrain.models.gpt.generate)
from distrain.models.sequence import WHOLE


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head != 0:
            raise ConfigError(
                f"GPTConfig: n_embd {self.n_embd} is not divisible by n_head {self.n_head}; "
                f"choose n_embd a multiple of n_head (e.g. {self.n_head * max(1, round(self.n_embd / self.n_head))})"
            )
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


class Embedding(nn.Module):
    """Token + learned position embedding: ids (B, T) -> (B, T, C)."""

    sequence = WHOLE  # the positions of the T tokens held (models/sequence.py)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.block_size = config.block_size
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[-1]
        if self.sequence.length(T) > self.wpe.num_embeddings:
            raise ConfigError(f"sequence length {self.sequence.length(T)} exceeds block_size {self.wpe.num_embeddings}")
        pos = self.sequence.positions(T, idx.device)                          # (T,)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, T) of the tokens after the cached ones -> (B, T, C), at positions ``cache.length ..``."""
        check_whole(self)
        return self.drop(self.wte(idx) + self.wpe(cache.positions(idx.shape[-1], idx.device)))


class CausalSelfAttention(nn.Module):
    sequence = WHOLE  # attention over the whole sequence from the tokens held (models/sequence.py)

    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.head_dim = config.head_dim  # plain int: the head count is derived from q_proj at run time
        self.q_proj = nn.Linear(C, C, bias=True)
        self.k_proj = nn.Linear(C, C, bias=True)
        self.v_proj = nn.Linear(C, C, bias=True)
        self.o_proj = nn.Linear(C, C, bias=True)
        self.dropout = config.dropout
        self.resid_drop = nn.Dropout(config.dropout)

    @property
    def n_local_heads(self) -> int:
        return self.q_proj.out_features // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._qkv(x)                                                # (B, h, T, hd) each
        y = self.sequence.attend(q, k, v, causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, -1)                               # (B, T, h * hd)
        return self.resid_drop(self.o_proj(y))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, i: int) -> torch.Tensor:
        """x (B, T, C) of the tokens after the ``cache.length`` cached ones -> (B, T, C); their keys and
        values are stored as block ``i``'s (inference: no dropout)."""
        check_whole(self)
        B, T, _ = x.shape
        q, k, v = self._qkv(x)                                                # (B, h, T, hd) each
        k, v = cache.update(i, k, v)                                          # (B, h, length + T, hd) each
        y = attend_cached(q, k, v, cache.length).transpose(1, 2).reshape(B, T, -1)   # (B, T, h * hd)
        return self.resid_drop(self.o_proj(y))

    def _qkv(self, x: torch.Tensor):
        """q, k, v (B, h, T, hd) of x (B, T, C), h this rank's heads (all without tensor parallelism)."""
        B, T, _ = x.shape
        n_local_heads = self.q_proj.out_features // self.head_dim
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, n_local_heads, hd).transpose(1, 2)  # (B, h, T, hd)
        k = self.k_proj(x).view(B, T, n_local_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, n_local_heads, hd).transpose(1, 2)
        return q, k, v


class MLPBlock(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        C = config.n_embd
        self.fc = nn.Linear(C, 4 * C, bias=True)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * C, C, bias=True)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x))."""

    checkpointable = True  # --activation-checkpointing recomputes this block in backward (activation_checkpointing.py)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLPBlock(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x

    def forward_cached(self, x: torch.Tensor, cache: KVCache, i: int) -> torch.Tensor:
        """``forward`` of the new tokens x (B, T, C), attending to block ``i``'s cached keys/values."""
        x = x + self.attn.forward_cached(self.ln_1(x), cache, i)
        return x + self.mlp(self.ln_2(x))


class Head(nn.Module):
    """Final LayerNorm + linear to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


class GPT(CachedDecoding, nn.Module):
    """Decoder-only transformer; ``forward(idx)`` returns logits (B, T, vocab_size).

    No weight tying between ``wte`` and ``lm_head``: tying would make the first and
    the last pipeline stage share a parameter (and its gradient), so they could not
    be placed on different ranks independently. With V=256 untying costs V*C params.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            [Embedding(config)] + [Block(config) for _ in range(config.n_layer)] + [Head(config)]
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) for linear and embedding weights, zero biases,
        LayerNorm (1, 0), and residual projections (attn.o_proj, mlp.proj) with
        std 0.02 / sqrt(2 * n_layer). Deterministic under torch.manual_seed."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = resid_std if name.endswith(("attn.o_proj", "mlp.proj")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x


def lm_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy of the logits (..., V) in ``output`` (models/outputs.py) against int targets (...)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
