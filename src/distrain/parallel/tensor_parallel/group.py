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
    torch ProcessGroup cannot be copied, and a copy of a shard belongs to the same group."""

    def __init__(self, group=None, algorithm: str = "native"):
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

    def __deepcopy__(self, memo):
        return self

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size}, algorithm={self.algorithm!r})"


def as_tp_group(group, algorithm: str) -> TPGroup:
    """``group`` as a TPGroup: itself if it is one, else a TPGroup of that ProcessGroup (None: the world)."""
    return group if isinstance(group, TPGroup) else TPGroup(group, algorithm)


def divide_by_tp(n: int, p: int, what: str) -> int:
    """n // p, the part of dimension ``what`` (n) on each of p tp ranks; a ConfigError if p does not divide n."""
    check_tp_divides(p, {what: n}, "a tensor-parallel layer")
    return n // p
