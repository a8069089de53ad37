"""A Llama-family decoder (Llama 2/3, SmolLM2), laid out for pipeline and tensor parallelism.

Touvron et al., "LLaMA" (2023) and "Llama 2" (2023); Meta, "The Llama 3 Herd of Models" (2024).
A pre-norm decoder-only transformer with

* RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019):
  ``y = x / sqrt(mean(x^2) + eps) * g`` -- no mean subtraction, no bias;
* rotary position embeddings on queries and keys (Su et al., RoFormer, 2021; :mod:`.rope`),
  in Hugging Face's rotate_half layout, no learned positions;
* grouped-query attention (Ainslie et al., "GQA", 2023): n_kv_head <= n_head key/value
  heads, each shared by n_head / n_kv_head query heads (kv head j serves query heads
  j*r .. j*r + r - 1, r = n_head / n_kv_head, as HF's ``repeat_kv``);
* a SwiGLU MLP (Shazeer, "GLU Variants Improve Transformer", 2020):
  ``w2(silu(w1 x) * w3 x)``;
* no biases anywhere; the output head tied to the token embedding or not.

Layout contract (as the GPT's, :mod:`distrain.models.gpt`; keep it when editing):

* ``Llama.layers = nn.ModuleList([LlamaEmbedding, LlamaBlock x n_layer, LlamaHead])`` and
  ``Llama.forward`` is ``for layer in self.layers: x = layer(x)``; a pipeline stage is a
  contiguous slice. Embedding: ids (B, T) -> (B, T, C); Block: (B, T, C) -> (B, T, C);
  Head: (B, T, C) -> logits (B, T, V). The loss (``lm_loss``) is outside.
* Module names (HF name in brackets; layer i of HF is ``layers.{i+1}`` here)::

      layers.0.tok_embeddings                    (model.embed_tokens)           V x C
      layers.N.attention_norm                    (input_layernorm)              C
      layers.N.attention.wq / wk / wv / wo       (self_attn.q/k/v/o_proj)       H*d x C, K*d x C, K*d x C, C x H*d
      layers.N.ffn_norm                          (post_attention_layernorm)     C
      layers.N.feed_forward.w1 / w3 / w2         (mlp.gate_proj / up_proj / down_proj)  F x C, F x C, C x F
      with ``moe`` (a mixture of experts, models/moe.py; Mixtral's names, hf.py):
      layers.N.feed_forward.gate                 (mlp.gate)                     E x C
      layers.N.feed_forward.experts.e.w1/w3/w2   (mlp.experts.gate_up_proj[e] / down_proj[e])
      layers.N.feed_forward.shared_expert.w1/w3/w2  (no Mixtral counterpart)
      layers.{n+1}.norm                          (model.norm)                   C
      layers.{n+1}.output                        (lm_head; untied only)         V x C
      layers.{n+1}.tied_output                   (tied: no parameter, reads tok_embeddings.weight)

* The attention reads its head counts from the weights at run time:
  ``n_local_heads = wq.out_features // head_dim``, ``n_local_kv_heads = wk.out_features //
  head_dim``, so wq/wk/wv may be replaced by column-parallel linears holding whole heads (and wo
  by a row-parallel one) without touching this file (the plan: :mod:`.plan`).
* ``LlamaEmbedding.sequence`` and ``Attention.sequence`` (``models/sequence.py``): the positions
  of the tokens the module holds (RoPE angles, the block-size check) and the attention over the
  whole sequence; the one-process ``WHOLE`` unless a context-parallel plan (``plan.py``
  ``llama_cp_plan``) set this rank's part of the sequence on the instance.
* Incremental decoding (one process, inference): ``Llama.new_cache()`` and
  ``Llama.forward_cached(idx, cache)`` (:mod:`distrain.models.kv_cache`) run only the new tokens,
  each block's ``forward_cached`` reading and extending the keys/values of the tokens before them,
  RoPE at the positions after the cached ones. ``forward`` (training, every parallel layout) does
  not touch a cache.
* Tied head: ``tied_output`` holds a (hidden) reference to the LlamaEmbedding and reads its
  ``tok_embeddings.weight`` at each forward, so the weight has one Parameter (one gradient, the
  sum of both uses) and a vocab-parallel embedding is read by the head as its own shard. A
  pipeline that puts the embedding and the head on different stages cannot share it: the tied
  head refuses to train when the embedding did not run in its process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.kv_cache import CachedDecoding, KVCache, attend_cached, check_whole
from distrain.models.moe import MoEConfig, MoEFeedForward
from distrain.models.llama.rope import LLAMA3_KEYS, apply_rotary, cos_sin, inv_frequencies
from distrain.models.sequence import WHOLE


def swiglu_hidden(n_embd: int, multiple_of: int = 32) -> int:
    """Meta's SwiGLU width: 2/3 of 4C (the same parameters as a 4C GELU MLP), rounded up."""
    h = int(2 * 4 * n_embd / 3)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


@dataclass
class LlamaConfig:
    """Sizes of a Llama. HF names: vocab_size, hidden_size (n_embd), num_hidden_layers (n_layer),
    num_attention_heads (n_head), num_key_value_heads (n_kv_head), intermediate_size,
    rms_norm_eps (norm_eps), rope_theta, rope_scaling (llama3), max_position_embeddings
    (block_size), tie_word_embeddings. Field names follow GPTConfig's where they mean the same."""

    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int | None = None         # None: n_head (plain multi-head attention)
    n_embd: int = 64
    intermediate_size: int | None = None  # None: swiglu_hidden(n_embd)
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # Llama 3: factor, low/high_freq_factor, original_max_position_embeddings
    tie_word_embeddings: bool = False
    moe: MoEConfig | dict | None = None   # a mixture of experts in every block's feed-forward (models/moe.py)

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = swiglu_hidden(self.n_embd) if isinstance(self.n_embd, int) else self.n_embd
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"LlamaConfig: n_embd {self.n_embd} must be n_head {self.n_head} times an even "
                              f"head_dim (rotary embeddings rotate channel pairs); e.g. n_embd "
                              f"{self.n_head * 2 * max(1, round(self.n_embd / self.n_head / 2))}")
        if self.n_head % self.n_kv_head:
            from distrain.parallel.tensor_parallel.sizes import divisors

            raise ConfigError(f"LlamaConfig: n_head {self.n_head} is not a multiple of n_kv_head {self.n_kv_head} "
                              f"(grouped-query attention shares each key/value head among n_head/n_kv_head query "
                              f"heads); choose n_kv_head among {divisors(self.n_head)}")
        for name in ("norm_eps", "rope_theta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"LlamaConfig.{name} must be a positive number, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"LlamaConfig.tie_word_embeddings must be True or False, "
                              f"got {self.tie_word_embeddings!r}")
        if self.rope_scaling is not None:
            self.rope_scaling = _check_scaling(self.rope_scaling)
        self.moe = MoEConfig.of(self.moe)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def _check_scaling(s) -> dict:
    if not isinstance(s, dict):
        raise ConfigError(f"LlamaConfig.rope_scaling must be a dict with {', '.join(LLAMA3_KEYS)} or None, got {s!r}")
    kind = s.get("rope_type", s.get("type", "llama3"))
    if kind != "llama3":
        raise ConfigError(f"LlamaConfig.rope_scaling: rope_type {kind!r} is not supported; only 'llama3' (or None)")
    missing = [k for k in LLAMA3_KEYS if k not in s]
    if missing:
        raise ConfigError(f"LlamaConfig.rope_scaling lacks {missing}; a llama3 scaling needs {', '.join(LLAMA3_KEYS)}")
    out = {k: s[k] for k in LLAMA3_KEYS}
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in out.values()) \
            or not out["high_freq_factor"] > out["low_freq_factor"]:
        raise ConfigError(f"LlamaConfig.rope_scaling: values must be positive with high_freq_factor > "
                          f"low_freq_factor, got {out}")
    return out


class RMSNorm(nn.Module):
    """``y = x / sqrt(mean(x^2, last dim) + eps) * weight`` (Zhang & Sennrich 2019, eq. 4).
    Half-precision inputs are normalised in float32 (as HF does); float32/64 in their own dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:          # (..., C) -> (..., C)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LlamaEmbedding(nn.Module):
    """Token embedding: ids (B, T) -> (B, T, C). No positions here: RoPE acts inside attention."""

    sequence = WHOLE  # how many tokens the whole sequence has (the block-size check; models/sequence.py)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.block_size = config.block_size
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.n_embd)
        self.ran_forward = False  # read by a tied head (see TiedOutput)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.sequence.length(idx.shape[-1]) > self.block_size:
            raise ConfigError(f"sequence length {self.sequence.length(idx.shape[-1])} exceeds block_size "
                              f"{self.block_size}")
        self.ran_forward = True
        return self.tok_embeddings(idx)                           # (B, T, C)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """ids (B, T) of the tokens after the cached ones -> (B, T, C) (the block-size check: the cache's)."""
        check_whole(self)
        cache.positions(idx.shape[-1])
        self.ran_forward = True
        return self.tok_embeddings(idx)                           # (B, T, C)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE on q and k (no biases)."""

    sequence = WHOLE  # positions of the tokens held, attention over the whole sequence (models/sequence.py)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, hd = config.n_embd, config.head_dim
        self.head_dim = hd  # plain int: head counts are derived from wq / wk at run time
        self.wq = nn.Linear(C, config.n_head * hd, bias=False)
        self.wk = nn.Linear(C, config.n_kv_head * hd, bias=False)
        self.wv = nn.Linear(C, config.n_kv_head * hd, bias=False)
        self.wo = nn.Linear(config.n_head * hd, C, bias=False)
        self.register_buffer("inv_freq", inv_frequencies(hd, config.rope_theta, config.rope_scaling),
                             persistent=False)                    # (hd/2,), recomputed from the config

    @property
    def n_local_heads(self) -> int:
        return self.wq.out_features // self.head_dim

    @property
    def n_local_kv_heads(self) -> int:
        return self.wk.out_features // self.head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self._rotated_qkv(x, self.sequence.positions(T, x.device))
        y = self.sequence.attend(q, k, v, causal=True)                   # (B, h, T, hd); kv head j serves
        # query heads j*r .. j*r+r-1, r = h / kv (grouped-query attention: models/sequence.py)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))               # (B, T, C)

    def forward_cached(self, x: torch.Tensor, cache: KVCache, i: int) -> torch.Tensor:
        """x (B, T, C) of the tokens after the ``cache.length`` cached ones -> (B, T, C); their keys and
        values (rotated at positions ``cache.length ..``) are stored as block ``i``'s."""
        check_whole(self)
        B, T, _ = x.shape
        q, k, v = self._rotated_qkv(x, cache.positions(T, x.device))
        k, v = cache.update(i, k, v)                                      # (B, kv, length + T, hd) each
        y = attend_cached(q, k, v, cache.length)                          # (B, h, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))               # (B, T, C)

    def _rotated_qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q (B, h, T, hd), k and v (B, kv, T, hd) of x (B, T, C), q and k rotated by RoPE at ``positions`` (T,)."""
        B, T, _ = x.shape
        hd = self.head_dim
        h, kv = self.wq.out_features // hd, self.wk.out_features // hd   # this rank's heads (all: no TP)
        q = self.wq(x).view(B, T, h, hd).transpose(1, 2)                  # (B, h, T, hd)
        k = self.wk(x).view(B, T, kv, hd).transpose(1, 2)                 # (B, kv, T, hd)
        v = self.wv(x).view(B, T, kv, hd).transpose(1, 2)                 # (B, kv, T, hd)
        cos, sin = cos_sin(self.inv_freq, positions, q.dtype)             # (T, hd) each
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``, (B, T, C) -> (B, T, F) -> (B, T, C)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        C, Fh = config.n_embd, config.intermediate_size
        self.w1 = nn.Linear(C, Fh, bias=False)  # gate
        self.w3 = nn.Linear(C, Fh, bias=False)  # up
        self.w2 = nn.Linear(Fh, C, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: ``h = x + attention(attention_norm(x))``, ``h + feed_forward(ffn_norm(h))``."""

    checkpointable = True  # --activation-checkpointing recomputes this block in backward (activation_checkpointing.py)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.norm_eps)
        self.feed_forward = FeedForward(config) if config.moe is None else \
            MoEFeedForward(config.n_embd, config.intermediate_size, config.moe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))

    def forward_cached(self, x: torch.Tensor, cache: KVCache, i: int) -> torch.Tensor:
        """``forward`` of the new tokens x (B, T, C), attending to block ``i``'s cached keys/values."""
        x = x + self.attention.forward_cached(self.attention_norm(x), cache, i)
        return x + self.feed_forward(self.ffn_norm(x))


class TiedOutput(nn.Module):
    """The head's projection with the token embedding's weight: (B, T, C) -> (B, T, V).
    No parameter of its own; the embedding is referenced, not registered (one Parameter)."""

    def __init__(self, embedding: LlamaEmbedding):
        super().__init__()
        self._embedding = (embedding,)  # a tuple: hidden from named_modules / state_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        emb = self._embedding[0]
        if self.training and torch.is_grad_enabled() and not emb.ran_forward:
            raise ConfigError("tie_word_embeddings: the output head shares the token embedding's weight, but the "
                              "embedding did not run in this process (a pipeline put them on different stages); "
                              "train with tie_word_embeddings=False, or keep embedding and head on one stage")
        return F.linear(x, emb.tok_embeddings.weight)  # (B, T, V), or (B, T, V/P) for a vocab-parallel table


class LlamaHead(nn.Module):
    """Final RMSNorm + projection to vocabulary logits: (B, T, C) -> (B, T, V)."""

    def __init__(self, config: LlamaConfig, embedding: LlamaEmbedding):
        super().__init__()
        self.norm = RMSNorm(config.n_embd, config.norm_eps)
        if config.tie_word_embeddings:
            self.tied_output = TiedOutput(embedding)
        else:
            self.output = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.tied_output if hasattr(self, "tied_output") else self.output
        return proj(self.norm(x))


class Llama(CachedDecoding, nn.Module):
    """Decoder-only Llama; ``forward(idx (B, T))`` returns logits (B, T, vocab_size)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        emb = LlamaEmbedding(config)
        self.layers = nn.ModuleList([emb] + [LlamaBlock(config) for _ in range(config.n_layer)]
                                    + [LlamaHead(config, emb)])
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """N(0, 0.02) for linear and embedding weights (HF's initializer_range), RMSNorm weights 1,
        and the residual projections (wo, every w2: the dense MLP's, each expert's) N(0, 0.02 /
        sqrt(2 * n_layer)) (GPT-2's scaling).
        Deterministic under torch.manual_seed."""
        resid_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=resid_std if name.endswith(("attention.wo", ".w2"))
                                else 0.02)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = idx
        for layer in self.layers:
            x = layer(x)
        return x
