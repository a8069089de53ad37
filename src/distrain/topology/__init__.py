"""The grid of ranks for data (dp), context (cp), tensor (tp) and pipeline (pp) parallelism.

A :class:`Topology` is passed around explicitly (there is no global singleton and
no environment variable is read). The pure part -- sizes, this rank's coordinates,
the ranks of every group, neighbours -- needs no processes; only
:meth:`Topology.from_world` touches ``torch.distributed`` to create process groups. Which
sizes are accepted, and what is suggested instead, is sizes.py.

Layout: tp varies fastest, then cp, then dp, then pp (``ORDER``, outermost first)::

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

With cp = 1 (the default) this is the dp x tp x pp grid it always was:
``pp_rank * (dp * tp) + dp_rank * tp + tp_rank``.

Why this order (the same as Megatron-LM's tp-cp-dp-pp): tensor-parallel peers talk the
most (two all-reduces of the whole activation per transformer block, forward and
backward), so they get neighbouring ranks, i.e. the same node / NVLink island.
Context-parallel peers come next: every attention passes keys and values around the cp
ring (or exchanges heads for sequence, all-to-all), forward and backward, a fraction of
the activation per layer. Data-parallel peers talk once per step (the gradient
all-reduce). Pipeline stages talk the least (one activation per micro-batch,
point-to-point), so pp is the outermost axis and its groups may cross nodes.

Every axis is handled by the same code (strides from ``ORDER``), so a new one (experts,
ep) is one more name in ``ORDER``, ``AXES`` and ``Coords`` plus its size field. Joint
groups span several axes at once: ``"dp_cp"`` holds the ranks that share tp and pp (the
ones that hold the same parameter shard and average its gradients: data and context
parallelism both split the tokens of a step), ``topo.dp_cp_group``.

Worked example, dp=2, tp=2, pp=2 (8 ranks)::

    rank: 0 1 2 3 4 5 6 7
    pp:   0 0 0 0 1 1 1 1
    dp:   0 0 1 1 0 0 1 1
    tp:   0 1 0 1 0 1 0 1

    tp groups: [0,1] [2,3] [4,5] [6,7]
    dp groups: [0,2] [1,3] [4,6] [5,7]
    pp groups: [0,4] [1,5] [2,6] [3,7]

Rank 5 is (pp=1, dp=0, tp=1); its tp peers are [4,5], its dp peers [5,7], and its
previous pipeline stage is rank 1 (it is the last stage, so ``pp_next`` is None).

With context parallelism, dp=2, cp=2, tp=1, pp=1 (4 ranks)::

    rank: 0 1 2 3
    dp:   0 0 1 1
    cp:   0 1 0 1

    cp groups: [0,1] [2,3]      dp groups: [0,2] [1,3]      dp_cp group: [0,1,2,3]

Expert parallelism (``ep``, distrain.parallel.expert_parallel) is not a fifth factor of the world: it
borrows ranks from dp x cp, as torchtitan's and Megatron-Core's do. The ranks of a dp_cp group hold
the same non-expert parameters and read different tokens; numbered i = dp_rank * cp + cp_rank, they
split into consecutive blocks of ep (the ``ep`` groups: ep ranks that pool their experts, E/ep
each, and exchange tokens all-to-all) and, across the blocks, the ranks at the same place in their
block (the ``edp`` groups, dp*cp/ep ranks: replicas of the same experts, whose gradients they sum).
So ep must divide dp * cp. Why borrow rather than add an axis: expert parallelism splits only the
experts, while every rank of the ep group still reads its own tokens -- exactly what a data-parallel
rank does -- so a separate axis would only replicate the tokens' work. Consecutive blocks put ep
peers on neighbouring dp_cp ranks (with ep = cp the ep groups are the cp groups).

With dp=4, ep=2 (4 ranks)::

    ep groups: [0,1] [2,3]      edp groups: [0,2] [1,3]     (rank 0 and 2 hold experts 0..E/2-1)

DiLoCo's islands (``islands`` K, --strategy diloco with a grid inside each island) are one more axis,
outside all of them: the world is K islands of dp * cp * tp * pp consecutive ranks each,

    rank = island * (dp * cp * tp * pp) + (the rank inside the island, as above)

and every group above lies inside one island (an island is a whole grid of its own). Two groups span
them: ``"island"``, this rank's island's ranks, and ``"cross"``, the ranks with this rank's coordinates
in every island (which hold the same shard: DiLoCo's outer all-reduce runs over them). With dp=1,
tp=2, islands=2 (4 ranks): tp groups [0,1] [2,3], island groups [0,1] [2,3], cross groups [0,2] [1,3].
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from datetime import timedelta
from typing import Any, NamedTuple

from distrain.errors import ConfigError
from distrain.topology.sizes import checked_world_size

AXES = ("dp", "tp", "pp", "cp")
ORDER = ("pp", "dp", "cp", "tp")  # the rank's digits, outermost (slowest) first
JOINT = {"dp_cp": ("dp", "cp")}  # groups over several axes: name -> axes
ISLAND = {"island": ORDER, "cross": ("island",)}  # DiLoCo's: this rank's island, its place in every island
EXPERT = ("ep", "edp")  # groups carved out of dp_cp by ep (module docstring)
# Order in which from_world creates groups; every rank must use the same one.
_GROUP_CREATION_ORDER = ("tp", "cp", "dp", "pp")


class Coords(NamedTuple):
    """A rank's position in the grid. The fields pp, dp, tp come first (outermost first: with
    cp = 1, sorting coords sorts ranks), cp last with a default, so ``Coords(pp, dp, tp)`` still
    names a position of a grid without context parallelism."""

    pp: int
    dp: int
    tp: int
    cp: int = 0


@dataclasses.dataclass(frozen=True)
class Topology:
    """How ``world_size`` ranks form a dp x cp x tp x pp grid, seen from ``rank``.

    Pure and immutable: building one starts no process. ``world_size`` defaults to
    ``dp * cp * tp * pp``. Invalid sizes or rank raise :class:`ConfigError` (the rules: sizes.py).
    ``cp`` comes after pp (``Topology(dp, tp, pp, cp)``) so that positional dp, tp, pp keep their
    meaning.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism: borrows ranks from dp x cp (module docstring)
    _: dataclasses.KW_ONLY
    islands: int = 1  # DiLoCo's islands, each a whole grid of dp x cp x tp x pp ranks (module docstring)
    rank: int = 0
    world_size: int | None = None
    # Process groups, set only by from_world; not part of equality or repr.
    _groups: dict[str, Any] | None = dataclasses.field(
        default=None, init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "world_size", checked_world_size(self))  # frozen: set once here (sizes.py)

    def stride(self, axis: str) -> int:
        """How far apart in rank two neighbours along ``axis`` are: the product of the sizes of
        the axes inside it in ``ORDER`` (tp: 1, cp: tp, dp: cp * tp, pp: dp * cp * tp)."""
        inner = ORDER[ORDER.index(self._check_axis(axis)) + 1:]
        return math.prod(getattr(self, a) for a in inner)

    @property
    def per_island(self) -> int:
        """Ranks in one island: dp * cp * tp * pp (the world when islands is 1)."""
        return self.world_size // self.islands

    def _size(self, axis: str) -> int:
        return self.islands if axis == "island" else getattr(self, axis)

    def coords_of(self, rank: int) -> Coords:
        """Coordinates of any global ``rank`` (the inverse of :meth:`rank_of`)."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank!r} is out of range [0, {self.world_size})")
        inside = rank % self.per_island
        return Coords(**{a: (inside // self.stride(a)) % getattr(self, a) for a in ORDER})

    def island_of(self, rank: int) -> int:
        """The DiLoCo island of any global ``rank`` (its coordinates, :meth:`coords_of`, are inside it)."""
        return rank // self.per_island

    @property
    def coords(self) -> Coords:
        return self.coords_of(self.rank)

    dp_rank = property(lambda self: self.coords.dp, doc="This rank's index along dp.")
    tp_rank = property(lambda self: self.coords.tp, doc="This rank's index along tp.")
    pp_rank = property(lambda self: self.coords.pp, doc="This rank's index (stage) along pp.")
    cp_rank = property(lambda self: self.coords.cp, doc="This rank's index along cp (its chunks of the sequence).")
    island = property(lambda self: self.island_of(self.rank), doc="This rank's DiLoCo island (0 when islands is 1).")

    def size_of(self, axis: str) -> int:
        """Size of ``axis`` (one of "dp", "tp", "pp", "cp"), of a joint group ("dp_cp": dp * cp), or of
        an expert group ("ep": ep, "edp": dp * cp / ep)."""
        if axis in EXPERT:
            return self.ep if axis == "ep" else self.dp * self.cp // self.ep
        return math.prod(self._size(a) for a in self._axes(axis))

    def _expert_ranks(self, axis: str, c: Coords, island: int = 0) -> list[int]:
        """The ep or edp group of the rank at ``c``: its dp_cp group (in rank order: i = dp * cp + cp)
        cut into consecutive blocks of ep (ep), or every ep-th of it from its place in its block (edp)."""
        ranks = self._ranks_along("dp_cp", c, island)
        i = c.dp * self.cp + c.cp
        block = i // self.ep * self.ep
        return ranks[block:block + self.ep] if axis == "ep" else ranks[i % self.ep::self.ep]

    @property
    def ep_rank(self) -> int:
        """This rank's index in its ep group: which E/ep experts it holds."""
        c = self.coords
        return (c.dp * self.cp + c.cp) % self.ep

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0, island: int = 0) -> int:
        """Global rank at the given coordinates; each must lie in [0, axis size)."""
        given = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "island": island}
        for name in AXES + ("island",):
            v, size = given[name], self._size(name)
            if not isinstance(v, int) or not 0 <= v < size:
                raise ConfigError(f"{name} coordinate {v!r} is out of range [0, {size})")
        return island * self.per_island + sum(given[a] * self.stride(a) for a in ORDER)

    @staticmethod
    def _check_axis(axis: str) -> str:
        if axis not in AXES:
            raise ConfigError(f"unknown axis {axis!r}; valid axes are {', '.join(map(repr, AXES))}")
        return axis

    @classmethod
    def _axes(cls, axis: str) -> tuple[str, ...]:
        """The axes a group name spans: one axis, or a joint group's (JOINT, ISLAND)."""
        if axis in JOINT:
            return JOINT[axis]
        if axis in ISLAND:
            return ISLAND[axis]
        if axis not in AXES:
            raise ConfigError(f"unknown axis {axis!r}; valid axes are {', '.join(map(repr, AXES))} "
                              f"(and the joint groups {', '.join(map(repr, (*JOINT, *ISLAND)))})")
        return (axis,)

    def _ranks_along(self, axis: str, c: Coords, island: int = 0) -> list[int]:
        """Ranks sharing every coordinate of ``c`` except those of ``axis`` (a joint group: all of
        its axes), in rank order (for one axis: axis order); an expert group: :meth:`_expert_ranks`."""
        if axis in EXPERT:
            return self._expert_ranks(axis, c, island)
        axes, fixed = self._axes(axis), {**c._asdict(), "island": island}
        out = []
        for values in itertools.product(*(range(self._size(a)) for a in axes)):
            fixed.update(zip(axes, values))
            out.append(self.rank_of(**fixed))
        return sorted(out)

    def groups_of(self, axis: str) -> list[list[int]]:
        """Every group along ``axis`` (or joint group, e.g. "dp_cp"): a partition of the world,
        ordered by smallest rank.

        The order depends only on the sizes, never on ``rank``, so all ranks see the
        same list -- required because ``new_group`` must be called identically everywhere.
        """
        if axis in EXPERT:
            seen = dict.fromkeys(tuple(self._expert_ranks(axis, self.coords_of(r), self.island_of(r)))
                                 for r in range(self.world_size))
            return sorted(list(g) for g in seen)
        axes = self._axes(axis)
        groups = []
        for r in range(self.world_size):
            c, island = self.coords_of(r), self.island_of(r)
            if all((island if a == "island" else getattr(c, a)) == 0 for a in axes):  # its first member names it
                groups.append(self._ranks_along(axis, c, island))
        return groups

    def ranks_of(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis`` (or joint group), in axis order."""
        return self._ranks_along(axis, self.coords, self.island)

    dp_ranks = property(lambda self: self.ranks_of("dp"), doc="Ranks of this rank's dp group.")
    tp_ranks = property(lambda self: self.ranks_of("tp"), doc="Ranks of this rank's tp group.")
    pp_ranks = property(lambda self: self.ranks_of("pp"), doc="Ranks of this rank's pp group.")
    cp_ranks = property(lambda self: self.ranks_of("cp"), doc="Ranks of this rank's cp group.")
    dp_cp_ranks = property(lambda self: self.ranks_of("dp_cp"),
                           doc="Ranks holding this rank's parameter shard: its dp x cp group.")
    ep_ranks = property(lambda self: self.ranks_of("ep"), doc="Ranks pooling their experts with this one.")
    edp_ranks = property(lambda self: self.ranks_of("edp"), doc="Ranks holding the same experts as this one.")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def pp_prev(self) -> int | None:
        """Global rank of the previous pipeline stage, None on the first stage."""
        return None if self.is_first_stage else self.pp_ranks[self.pp_rank - 1]

    @property
    def pp_next(self) -> int | None:
        """Global rank of the next pipeline stage, None on the last stage."""
        return None if self.is_last_stage else self.pp_ranks[self.pp_rank + 1]

    def ring_next(self, axis: str) -> int:
        """Next rank in this rank's ``axis`` group, wrapping around (itself if size 1)."""
        ranks = self.ranks_of(axis)
        return ranks[(ranks.index(self.rank) + 1) % len(ranks)]

    def ring_prev(self, axis: str) -> int:
        """Previous rank in this rank's ``axis`` group, wrapping around (itself if size 1)."""
        ranks = self.ranks_of(axis)
        return ranks[(ranks.index(self.rank) - 1) % len(ranks)]

    def describe(self) -> str:
        """Short multi-line description: the grid (one block per pp stage) and this rank."""
        c = self.coords
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        lines = [f"Topology dp={self.dp}{cp} tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")
                 + (f" islands={self.islands}" if self.islands > 1 else "") + f" (world size {self.world_size})"]
        if self.islands > 1:
            lines.append(f"  (island 0 below; island i is the same grid shifted by i x {self.per_island}; cross "
                         f"groups {self.groups_of('cross')})")
        cols = "cp x tp" if self.cp > 1 else "tp"
        for p in range(self.pp):
            rows = [[self.rank_of(dp=d, cp=k, tp=t, pp=p) for k in range(self.cp) for t in range(self.tp)]
                    for d in range(self.dp)]
            lines.append(f"  pp stage {p} (rows dp, columns {cols}): {rows}")
        lines.append(f"  this rank {self.rank}: " + (f"island={self.island} " if self.islands > 1 else "")
                     + f"pp={c.pp} dp={c.dp}" + (f" cp={c.cp}" if self.cp > 1 else "")
                     + f" tp={c.tp}" + (f" ep={self.ep_rank}" if self.ep > 1 else ""))
        if self.ep > 1:
            lines.append(f"  ep={self.ep} (borrowed from dp x cp): ep groups {self.groups_of('ep')}, expert replicas "
                         f"(edp) {self.groups_of('edp')}")
        return "\n".join(lines)

    @classmethod
    def from_world(
        cls, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, *, islands: int = 1,
        backend_timeout: timedelta | float | None = None
    ) -> Topology:
        """Build the topology of the initialised world and create its process groups.

        Collective: every rank must call it with the same sizes. Every rank calls
        ``torch.distributed.new_group`` for every group of every axis (order: tp, cp, dp,
        pp; groups in ``groups_of`` order), then, when cp > 1, for every dp_cp group (with
        cp = 1 it is the dp group), then, when ep > 1, for every ep and edp group, then, when islands > 1,
        for every island and cross group, and keeps the groups it belongs to.
        ``backend_timeout`` (timedelta or seconds) is passed to ``new_group``.
        """
        import torch.distributed as dist  # only the distributed part needs torch

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                "Topology.from_world needs an initialised torch.distributed process group; "
                "call distrain.runtime.init() or use distrain.spawn first "
                "(or build a pure Topology(dp, tp, pp, rank=..., world_size=...))"
            )
        topo = cls(dp, tp, pp, cp, ep, islands=islands, rank=dist.get_rank(), world_size=dist.get_world_size())
        kwargs: dict[str, Any] = {}
        if backend_timeout is not None:
            if not isinstance(backend_timeout, timedelta):
                backend_timeout = timedelta(seconds=float(backend_timeout))
            kwargs["timeout"] = backend_timeout
        groups: dict[str, Any] = {}
        for axis in _GROUP_CREATION_ORDER + tuple(j for j, axes in JOINT.items() if topo.size_of(j) > max(
                getattr(topo, a) for a in axes)) + (EXPERT if topo.ep > 1 else ()) + (
                tuple(ISLAND) if topo.islands > 1 else ()):  # a joint group equal to one
            # axis's is that axis's
            for ranks in topo.groups_of(axis):
                # new_group is collective over the whole world: call it for every group,
                # even those this rank is not in, or the ranks deadlock / mismatch. A group of
                # every rank is the world's own (plain data parallelism: DDP and ZeRO on the
                # default group, its transport and sequence numbers, not a copy of them)
                pg = dist.group.WORLD if len(ranks) == topo.world_size else dist.new_group(ranks, **kwargs)
                if topo.rank in ranks:
                    groups[axis] = pg
        object.__setattr__(topo, "_groups", groups)
        return topo

    def group(self, axis: str) -> Any:
        """This rank's ProcessGroup along ``axis`` (or joint group: "dp_cp"); only on a Topology
        from from_world."""
        axes = self._axes(axis) if axis not in EXPERT else ()
        if axis in ISLAND and self._groups is not None and self.islands == 1:
            return None  # one island: the world (island), nothing across (cross)
        if self._groups is None:
            raise ConfigError(
                f"{axis}_group exists only on a Topology built with Topology.from_world(...); "
                "this one is pure (no process groups)"
            )
        if axis in EXPERT and axis not in self._groups:  # ep = 1: no expert groups (None: one rank, nothing sent)
            return None if axis == "ep" else self.group("dp_cp")
        if axis not in self._groups:  # a joint group that equals one of its axes' (the others have size 1)
            return self._groups[max(axes, key=lambda a: getattr(self, a))]
        return self._groups[axis]

    dp_group = property(lambda self: self.group("dp"), doc="This rank's data-parallel ProcessGroup.")
    tp_group = property(lambda self: self.group("tp"), doc="This rank's tensor-parallel ProcessGroup.")
    pp_group = property(lambda self: self.group("pp"), doc="This rank's pipeline ProcessGroup.")
    cp_group = property(lambda self: self.group("cp"), doc="This rank's context-parallel ProcessGroup.")
    dp_cp_group = property(lambda self: self.group("dp_cp"),
                           doc="This rank's dp x cp ProcessGroup: the ranks that average one shard's gradients.")
    ep_group = property(lambda self: self.group("ep"),
                        doc="This rank's expert-parallel ProcessGroup (None when ep is 1).")
    edp_group = property(lambda self: self.group("edp"),
                         doc="The ranks holding this rank's experts (the dp x cp group when ep is 1).")
    island_group = property(lambda self: self.group("island"),
                            doc="This rank's DiLoCo island (None when islands is 1: the world, as comm reads None).")
    cross_group = property(lambda self: self.group("cross"),
                           doc="The ranks at this rank's place in every island (None when islands is 1: none).")
