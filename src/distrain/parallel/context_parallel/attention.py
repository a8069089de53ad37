"""``ContextParallel``: where this rank's tokens sit in the sequence, and attention across the cp group.

A model that can be split along the sequence asks one object, its modules' ``sequence``
attribute, three things (distrain's GPT and Llama do: ``models/sequence.py`` holds the
one-process default, ``WholeSequence``)::

    sequence.positions(T, device)    global positions of the T local tokens (position embeddings, RoPE)
    sequence.length(T)               the whole sequence's length (the block-size check)
    sequence.attend(q, k, v, causal=True, dropout_p=0.0, scale=None)
                                     q (B,h,T,d), k/v (B,g,T,d), g | h (grouped-query attention)
                                     -> (B,h,T,d): attention of the local queries over every token

A :class:`ContextParallel` answers them for rank r of a cp group of N: its T = T_all / N tokens
are chunks r and 2N-1-r of the sequence (:mod:`.load_balance`), and ``attend`` is ring attention
(:mod:`.ring`, keys and values passed around) or the all-to-all (:mod:`.ulysses`, heads exchanged
for sequence), by ``variant``. A plan (:mod:`.plan`) sets it on the modules a model names;
``split`` cuts the batch (inputs and targets) the same way.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.errors import ConfigError
from distrain.parallel.context_parallel import load_balance
from distrain.parallel.context_parallel.ring import expand_kv, ring_attention
from distrain.parallel.context_parallel.sizes import check_cp_heads
from distrain.parallel.context_parallel.ulysses import ulysses_attention

__all__ = ["VARIANTS", "ContextParallel", "check_variant"]

VARIANTS = ("ring", "all-to-all")


def check_variant(variant: str) -> str:
    if variant not in VARIANTS:
        raise ConfigError(f"context parallel: unknown variant {variant!r}; use ring (keys and values passed around "
                          f"the cp ring) or all-to-all (Ulysses: heads exchanged for sequence)")
    return variant


class ContextParallel:
    """Rank ``rank`` of a context-parallel group of ``size`` ranks: its place in the sequence and
    its attention over the whole of it (``variant``: "ring" or "all-to-all"). Copies of a module
    (``copy.deepcopy``) share it, as they share a torch ProcessGroup."""

    def __init__(self, group=None, variant: str = "ring"):
        check_variant(variant)
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("context parallel: torch.distributed is not initialized; call distrain.runtime.init() "
                              "(under `distrain launch`) or run under distrain.spawn")
        group = dist.group.WORLD if group is None else group
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(f"context parallel: this process (global rank {dist.get_rank()}) is not a member of the "
                              f"cp group it was given; pass this rank's group (e.g. topo.cp_group)")
        self.group, self.variant, self.rank, self.size = group, variant, rank, dist.get_world_size(group)
        self.ranks = dist.get_process_group_ranks(group)                      # global ranks, group order
        self.next = self.ranks[(rank + 1) % self.size]
        self.prev = self.ranks[(rank - 1) % self.size]

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"ContextParallel(rank={self.rank}, size={self.size}, variant={self.variant!r})"

    # -- the sequence ----------------------------------------------------------------------
    def positions(self, T: int, device=None) -> torch.Tensor:
        """Global positions (T,) of this rank's T local tokens."""
        return load_balance.positions(T * self.size, self.size, self.rank, device)

    def length(self, T: int) -> int:
        """The whole sequence's length, from this rank's T tokens."""
        return T * self.size

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the whole tensor ``x`` (its length along ``dim`` must be a multiple of 2N)."""
        return load_balance.split(x, self.size, self.rank, dim)

    # -- attention -------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
               dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
        """Attention of the local queries q (B,h,T,d) over the whole sequence's keys and values,
        whose local parts are k, v (B,g,T,d) -> (B,h,T,d). Collective over the cp group."""
        if dropout_p:
            raise ConfigError(f"context parallel: attention dropout (p={dropout_p}) is not supported (each rank would "
                              f"draw its own masks over blocks of the sequence); use dropout 0")
        if self.size == 1:
            h = q.shape[1]
            return torch.nn.functional.scaled_dot_product_attention(q, expand_kv(k, h), expand_kv(v, h),
                                                                    is_causal=causal, scale=scale)
        if self.variant == "ring":
            return ring_attention(q, k, v, self, causal, scale)
        if q.shape[1] % self.size or k.shape[1] % self.size:
            check_cp_heads(self.size, {"query heads": q.shape[1], "key/value heads": k.shape[1]}, "this attention")
        return ulysses_attention(q, k, v, self, causal, scale)
