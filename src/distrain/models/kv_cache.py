"""Keys and values of the tokens already seen, for incremental decoding in one process.

    cache = model.new_cache()                      # GPT or Llama: one (k, v) slot per block
    logits = model.forward_cached(prompt, cache)   # (B, T, V); the prompt's keys/values stored
    logits = model.forward_cached(nxt, cache)      # (B, 1, V): only the new token is computed

Without a cache, sampling token t runs the model over all t tokens again (t^2 work per token in
attention, t per token elsewhere); with one, only the new token's projections are computed and
its query attends to the stored keys: the work per token is the cost of one token plus one
attention row over the stored keys, so the whole generation is linear in its length (up to the
attention row). The cached positions are ``0 .. length - 1``: a new token sits at position
``length`` (GPT: its learned position row; Llama: its RoPE angle), exactly where the whole-sequence
forward puts it, so the logits equal the no-cache ones (to float rounding of the attention's
reduction order).

Contract: the cache holds the tokens of positions ``0 .. length - 1`` of one sequence batch and
at most ``max_len`` (the model's block size) of them; it is for inference in one process (a
context-parallel model refuses it: ``check_whole``). Sliding past ``max_len`` is not done here:
the model never saw positions past its block size, so :func:`distrain.models.generate` crops the
context and recomputes it instead, as without a cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.sequence import WholeSequence, expand_kv_heads

__all__ = ["KVCache", "attend_cached", "check_whole"]


class KVCache:
    """Per-block keys and values, each preallocated as (B, g, max_len, d) on the first write (so an
    append is a copy of the new rows, not of the whole history)."""

    def __init__(self, n_blocks: int, max_len: int):
        self.max_len = max_len
        self.length = 0  # tokens stored (the position of the next one)
        self._k: list[torch.Tensor | None] = [None] * n_blocks
        self._v: list[torch.Tensor | None] = [None] * n_blocks

    def positions(self, T: int, device=None) -> torch.Tensor:
        """Positions of ``T`` new tokens: ``length .. length + T - 1``, (T,); a ConfigError past max_len."""
        if self.length + T > self.max_len:
            raise ConfigError(f"KV cache: {self.length} cached + {T} new tokens exceed the block size {self.max_len}; "
                              f"start a new cache with the last {self.max_len} tokens")
        return torch.arange(self.length, self.length + T, device=device)

    def update(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store block ``i``'s keys/values of the new tokens, k/v (B, g, T, d), at positions ``length ..``;
        return every stored one, (B, g, length + T, d) each. :meth:`advance` moves ``length`` once all
        blocks have run."""
        B, g, T, d = k.shape
        if self._k[i] is None or self._k[i].shape[0] != B:
            self._k[i] = k.new_empty(B, g, self.max_len, d)                      # (B, g, max_len, d)
            self._v[i] = v.new_empty(B, g, self.max_len, d)
        end = self.length + T
        self._k[i][:, :, self.length:end] = k
        self._v[i][:, :, self.length:end] = v
        return self._k[i][:, :, :end], self._v[i][:, :, :end]

    def advance(self, T: int) -> None:
        self.length += T


def check_whole(module) -> None:
    """The cache is for one process holding the whole sequence: refuse a context-parallel module."""
    if not isinstance(module.sequence, WholeSequence):
        raise ConfigError(f"KV cache: {type(module).__name__} holds part of the sequence ({module.sequence!r}, "
                          f"context parallelism); decode with the whole model in one process")


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Causal attention of the T new queries q (B, h, T, d), at positions ``offset .. offset + T - 1``,
    over every stored key/value k, v (B, g, offset + T, d), g | h -> (B, h, T, d). Query i sees the
    keys of positions ``<= offset + i``."""
    h, T, S = q.shape[1], q.shape[2], k.shape[2]
    k, v = expand_kv_heads(k, h), expand_kv_heads(v, h)                          # (B, h, S, d)
    if offset == 0:  # the prompt: the whole-sequence causal attention, same call as WHOLE.attend
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if T == 1:  # one new token sees every stored one: no mask
        return F.scaled_dot_product_attention(q, k, v)
    keep = torch.arange(S, device=q.device)[None, :] <= offset + torch.arange(T, device=q.device)[:, None]  # (T, S)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


class CachedDecoding:
    """Mixed into a decoder whose ``layers`` are [embedding, *blocks, head] and whose ``config`` has
    n_layer and block_size (our GPT and Llama): each of those parts has its own ``forward_cached``."""

    def new_cache(self) -> KVCache:
        """An empty KV cache for :meth:`forward_cached` (up to block_size tokens)."""
        return KVCache(self.config.n_layer, self.config.block_size)

    def forward_cached(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Logits (B, T, V) of the tokens idx (B, T) that follow the ``cache.length`` cached ones, equal to
        the last T rows of ``forward`` over the whole sequence; their keys/values join the cache. One
        process, inference (the whole model in this process: ``self.layers`` intact)."""
        emb, *blocks, head = self.layers
        x = emb.forward_cached(idx, cache)                                # (B, T, C)
        for i, block in enumerate(blocks):
            x = block.forward_cached(x, cache, i)
        cache.advance(idx.shape[-1])
        return head(x)                                                    # (B, T, V)
