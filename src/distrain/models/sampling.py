"""Sampling text from a language model: temperature, top-k, top-p (nucleus), greedy, a KV cache.

    out = generate(model, idx, 200, temperature=0.8, top_k=40, top_p=0.95, generator=g, use_cache=True)

Each new token is drawn from the logits of the last position, in this order (Hugging Face's):
divided by ``temperature`` (0: greedy, the argmax, nothing drawn), cut to the ``top_k`` likeliest
tokens, then to the nucleus of ``top_p`` (Holtzman et al., "The Curious Case of Neural Text
Degeneration", 2020: the smallest set of the likeliest tokens whose probability reaches ``top_p``),
and one token is drawn with ``torch.multinomial`` and ``generator``: the same generator state gives
the same tokens, with or without the cache.

``use_cache`` (models with ``new_cache`` / ``forward_cached``: our GPT and Llama,
:mod:`distrain.models.kv_cache`): the prompt runs once, then each step runs the one new token
against the stored keys/values, so the time per token stays flat instead of growing with the
length. Once the sequence is longer than the block size the model can only see its last
``block_size`` tokens, at positions 0.., so every step recomputes that window, as without a cache.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.models.outputs import logits_of

__all__ = ["generate", "next_token", "top_p_keep"]


def top_p_keep(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Which tokens the nucleus keeps: a bool mask like ``probs`` (B, V), True for the smallest set of
    the likeliest tokens whose probability sums to at least ``top_p`` (the likeliest one always). A
    token is kept when the tokens likelier than it (ties: in sort order) sum to less than ``top_p``."""
    p, order = torch.sort(probs, dim=-1, descending=True)                        # (B, V) each
    before = torch.cumsum(p, dim=-1) - p                                          # mass of the likelier ones
    keep_sorted = before < top_p
    keep_sorted[..., 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)          # back to vocabulary order


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None,
               generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token (B, 1) from the last position's logits (B, V) (see the module docstring)."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        k = min(top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[:, -1:]                       # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)                                         # (B, V)
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(logits.masked_fill(~top_p_keep(probs, top_p), float("-inf")), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)


def context_size(model: nn.Module) -> int | None:
    """How many tokens the model sees: ``model.config.block_size``, else its first layer's position table
    (a GPT's ``wpe``), else None (no limit known: the whole context is given)."""
    n = getattr(getattr(model, "config", None), "block_size", None)
    if n is None:
        wpe = getattr(getattr(model, "layers", [None])[0], "wpe", None)
        n = getattr(wpe, "num_embeddings", None)
    return None if n is None else int(n)


@torch.no_grad()
def generate(model: nn.Module, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None, top_p: float | None = None,
             use_cache: bool = False, block_size: int | None = None) -> torch.Tensor:
    """Append ``max_new_tokens`` sampled tokens to ``idx`` (B, T) and return (B, T + new).

    The context is cropped to ``block_size`` (default: :func:`context_size`). ``temperature == 0``
    means greedy (argmax); ``top_k`` keeps the k most likely tokens; ``top_p`` the nucleus of that
    mass (None or 1: no cut); ``generator`` makes sampling reproducible. ``use_cache``: decode with a
    KV cache (the model needs ``new_cache``/``forward_cached``; the same tokens as without). The model
    is put in eval mode during sampling and restored after.
    """
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ConfigError(f"top_p must be in (0, 1] or None, got {top_p}")
    if use_cache and not hasattr(model, "forward_cached"):
        raise ConfigError(f"use_cache: {type(model).__name__} has no KV cache (distrain's GPT and Llama have one); "
                          f"generate without it")
    if idx.dim() == 1:
        idx = idx.unsqueeze(0)
    block_size = block_size or context_size(model)
    cache = model.new_cache() if use_cache else None
    cached_max = None if cache is None else min(cache.max_len, block_size or cache.max_len)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            if cache is not None and idx.shape[1] <= cached_max:  # the new tokens only: (B, T - cached)
                logits = logits_of(model.forward_cached(idx[:, cache.length:], cache))[:, -1, :]
            else:  # no cache, or past the block size: the last block_size tokens, at positions 0..
                logits = logits_of(model(idx if block_size is None else idx[:, -block_size:]))[:, -1, :]
            nxt = next_token(logits, temperature, top_k, top_p, generator)       # (B, 1)
            idx = torch.cat([idx, nxt.to(idx.dtype)], dim=1)
    finally:
        model.train(was_training)
    return idx
