"""Islands: K groups of M = world / K consecutive ranks.

Island i holds ranks i*M .. i*M + M - 1 (its ranks train one replica, data parallel over the island's
group). Across islands, the ranks with the same place j in their island form the cross group j,
{j, M + j, 2M + j, ...}: after an island's inner steps its M ranks hold the same parameters, so each cross
group averages the same outer gradients and every rank gets the averaged one without a collective inside
the island (each rank's bytes: one all-reduce of the model over K ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

from distrain import comm
from distrain.errors import ConfigError


def island_ranks(world: int, islands: int) -> list[list[int]]:
    """The ranks of each of ``islands`` islands of ``world`` ranks: consecutive runs of world / islands."""
    if islands < 1 or world % islands:
        raise ConfigError(f"--islands {islands} does not divide the {world} ranks into equal islands; use a "
                          f"divisor of {world}")
    m = world // islands
    return [list(range(i * m, (i + 1) * m)) for i in range(islands)]


@dataclass
class IslandGroups:
    """This rank's place: ``island`` (0..K-1), ``place`` in it (0..M-1); ``island_group``: its island's
    ranks (None when M = 1: nothing to synchronise inside), ``cross_group``: the ranks of its place in
    every island (None when K = 1: nothing to average across)."""

    islands: int
    per_island: int
    island: int
    place: int
    island_group: object | None
    cross_group: object | None

    @classmethod
    def build(cls, rank: int, world: int, islands: int) -> "IslandGroups":
        """Collective over the world: every rank creates every group, in the same order (new_group's rule)."""
        runs = island_ranks(world, islands)
        m = world // islands
        mine_island = mine_cross = None
        if m == world and m > 1:
            mine_island = comm.group.WORLD
        elif m > 1:
            for ranks in runs:
                g = comm.new_group(ranks)
                if rank in ranks:
                    mine_island = g
        if islands == world and islands > 1:
            mine_cross = comm.group.WORLD
        elif islands > 1:
            for j in range(m):
                ranks = [run[j] for run in runs]
                g = comm.new_group(ranks)
                if rank in ranks:
                    mine_cross = g
        return cls(islands, m, rank // m, rank % m, mine_island, mine_cross)
