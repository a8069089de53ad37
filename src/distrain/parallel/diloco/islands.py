"""Islands: K groups of M = world / K consecutive ranks.

Island i holds ranks i*M .. i*M + M - 1 (its ranks train one replica, data parallel over the island's
group). Across islands, the ranks with the same place j in their island form the cross group j,
{j, M + j, 2M + j, ...}: after an island's inner steps its M ranks hold the same parameters, so each cross
group averages the same outer gradients and every rank gets the averaged one without a collective inside
the island (each rank's bytes: one all-reduce of the model over K ranks).

An elastic job (--elastic with --islands K) keeps each rank in the island it started in (a newcomer founds
an island while fewer than K live, else joins the smallest: :func:`island_labels`); :func:`live_islands`
gives the islands of the live ranks, which may differ in size, and :meth:`IslandGroups.build_live` their
groups; there the outer mean is one all-reduce over the world to which only each island's first rank
brings its Δ_i (the others zeros: x + 0 is x, so the sum is the K islands' sum), as islands of different
sizes have no cross groups of one rank per island at every place.
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


def island_labels(islands: int, history: list[list[int]]) -> dict[int, int]:
    """Each rank id's island (a label) in an elastic job, from its memberships in order (``history[e]``: the
    ids of epoch e in rank order; epoch 0's, the starting ranks, cut into ``islands`` islands of consecutive
    ranks as :func:`island_ranks` cuts them). A rank keeps its island for good. A newcomer, at the first
    epoch that has it, founds a new island (a new label) while fewer than ``islands`` islands have a live
    rank, else joins the live island with the fewest ranks (ties: the first in island order, by its first
    rank). A pure function of the history, so every rank of every epoch, newcomers too, computes the same."""
    founders = history[0]
    labels = {founders[r]: k for k, run in enumerate(island_ranks(len(founders), islands)) for r in run}
    fresh = islands
    for ids in history[1:]:
        sizes: dict[int, int] = {}  # the epoch's islands (labels) in island order -> their ranks so far
        for i in ids:
            if i in labels:
                sizes[labels[i]] = sizes.get(labels[i], 0) + 1
        for i in ids:
            if i in labels:
                continue
            if len(sizes) < islands:
                labels[i], fresh = fresh, fresh + 1
            else:
                labels[i] = min(sizes, key=lambda k: sizes[k])  # (min keeps the first of equals: island order)
            sizes[labels[i]] = sizes.get(labels[i], 0) + 1
    return labels


def live_islands(islands: int, history: list[list[int]]) -> list[list[int]]:
    """The ranks of each island of the last membership (``history[-1]``; :func:`island_labels`), in island
    order: by each island's first rank (survivors keep their order and newcomers come after them, so the
    islands that go on keep theirs, and a new one is last)."""
    labels = island_labels(islands, history)
    runs: dict[int, list[int]] = {}
    for r, i in enumerate(history[-1]):
        runs.setdefault(labels[i], []).append(r)
    return list(runs.values())


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
    # an elastic job's live islands (build_live): the ranks of each island, and whether the outer mean is the
    # world's sum to which only each island's first rank brings its Δ_i (the cross group is then the world)
    runs: list[list[int]] | None = None
    leaders_only: bool = False

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

    @classmethod
    def build_live(cls, rank: int, world: int, runs: list[list[int]]) -> "IslandGroups":
        """Groups of islands of any sizes (``runs``: each island's ranks, :func:`live_islands`); collective over
        the world, every rank creating every island's group in island order. ``per_island``: this rank's
        island's size; ``cross_group``: the world when there are several islands (the outer sum over every
        rank, ``leaders_only`` when an island has more than one rank), None for one island."""
        mine_island = None
        for ranks in runs:
            if len(ranks) == world and world > 1:
                mine_island = comm.group.WORLD
            elif len(ranks) > 1:
                g = comm.new_group(ranks)
                if rank in ranks:
                    mine_island = g
        island = next(k for k, ranks in enumerate(runs) if rank in ranks)
        cross = comm.group.WORLD if len(runs) > 1 else None
        return cls(len(runs), len(runs[island]), island, runs[island].index(rank), mine_island, cross, runs,
                   leaders_only=cross is not None and len(runs) < world)
