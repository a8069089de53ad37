"""The tensor-parallel group as every layer holds it, and the size split the layers share
(checked by :func:`.sizes.check_tp_divides`, the one tp size check)."""

from __future__ import annotations

import torch.distributed as dist

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.sizes import check_tp_divides


class TPGroup:
    """A tensor-parallel group as the layers hold it: the ProcessGroup, the algorithm, and
    this rank's place in it. Copies of a layer (``copy.deepcopy``) share it: a
    torch ProcessGroup cannot be copied, and a copy of a shard belongs to the same group.

    ``chunks`` (``--layout-invariant``; None otherwise): the layers compute every split reduction as that
    many fixed chunks added in a fixed tree (:mod:`.invariant`), the same bits on any tp size dividing it.
    """

    def __init__(self, group=None, algorithm: str = "native", *, chunks: int | None = None):
        if algorithm not in comm.ALGORITHM_NAMES:
            raise ConfigError(f"tensor parallel: unknown algorithm {algorithm!r}; use one of "
                              f"{', '.join(comm.ALGORITHM_NAMES)}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError("tensor parallel: torch.distributed is not initialized; call "
                              "distrain.runtime.init() (under `distrain launch`) or run under distrain.spawn")
        if group is None:
            group = dist.group.WORLD
        rank = dist.get_rank(group)
        if rank < 0:
            raise ConfigError(f"tensor parallel: this process (global rank {dist.get_rank()}) is not a member "
                              f"of the tp group it was given; pass this rank's group (e.g. topo.tp_group)")
        self.group = group
        self.algorithm = algorithm
        self.rank = rank
        self.size = dist.get_world_size(group)
        self.chunks = chunks
        check_chunks(self)

    @classmethod
    def alone(cls, *, chunks: int | None = None) -> "TPGroup":
        """A group of this process alone (no torch.distributed needed): the layers issue no collective.
        With ``chunks``: one process computing the canonical chunked sums of ``--layout-invariant``."""
        tp = cls.__new__(cls)
        tp.group, tp.algorithm, tp.rank, tp.size, tp.chunks = None, "native", 0, 1, chunks
        check_chunks(tp)
        return tp

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        chunks = f", chunks={self.chunks}" if self.chunks else ""
        return f"TPGroup(rank={self.rank}, size={self.size}, algorithm={self.algorithm!r}{chunks})"


def check_chunks(tp: TPGroup) -> None:
    """The canonical chunks must be a power of two that the tp size divides."""
    c = tp.chunks
    if c is not None and (c < 1 or c & (c - 1) or c % tp.size):
        raise ConfigError(f"tensor parallel: {c} invariant chunks cannot be shared by tp={tp.size}; use a power "
                          f"of two that tp divides")


def as_tp_group(group, algorithm: str) -> TPGroup:
    """``group`` as a TPGroup: itself if it is one, else a TPGroup of that ProcessGroup (None: the world)."""
    return group if isinstance(group, TPGroup) else TPGroup(group, algorithm)


def divide_by_tp(n: int, p: int, what: str) -> int:
    """n // p, the part of dimension ``what`` (n) on each of p tp ranks; a ConfigError if p does not divide n."""
    check_tp_divides(p, {what: n}, "a tensor-parallel layer")
    return n // p
