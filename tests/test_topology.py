"""Tests of distrain.topology: the pure rank arithmetic, and from_world on 4 real Gloo ranks."""

from __future__ import annotations

import dataclasses
import itertools
import time
from datetime import timedelta

import pytest

from distrain.errors import ConfigError
from distrain.topology import Coords, Topology

from conftest import free_port

SHAPES = [(1, 1, 1), (3, 1, 1), (1, 3, 1), (1, 1, 5), (2, 3, 1), (3, 2, 2), (2, 2, 2), (2, 1, 3)]

# Hand-written table for dp=2, tp=2, pp=2: rank -> (pp, dp, tp).
TABLE_222 = {
    0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
    4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1),
}  # fmt: skip


# ---- pure logic ---------------------------------------------------------------------


@pytest.mark.parametrize("rank", range(8))
def test_rank_formula_222_matches_table(rank):
    t = Topology(2, 2, 2, rank=rank)
    pp, dp, tp = TABLE_222[rank]
    assert (t.pp_rank, t.dp_rank, t.tp_rank) == (pp, dp, tp)
    assert t.coords == Coords(pp=pp, dp=dp, tp=tp)
    assert t.rank_of(dp=dp, tp=tp, pp=pp) == rank


def test_groups_222_by_hand():
    t = Topology(2, 2, 2)
    assert t.groups_of("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups_of("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.groups_of("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    t5 = Topology(2, 2, 2, rank=5)
    assert (t5.tp_ranks, t5.dp_ranks, t5.pp_ranks) == ([4, 5], [5, 7], [1, 5])


def test_defaults_and_world_size():
    t = Topology()
    assert (t.dp, t.tp, t.pp, t.rank, t.world_size) == (1, 1, 1, 0, 1)
    assert Topology(3, 2, 2).world_size == 12
    assert Topology(2, 3, rank=5, world_size=6).world_size == 6


def test_frozen_and_equality():
    t = Topology(2, 2, 2, rank=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.rank = 4
    assert t == Topology(2, 2, 2, rank=3, world_size=8)
    assert t != Topology(2, 2, 2, rank=4)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("axis", ["dp", "tp", "pp"])
def test_groups_partition_world(shape, axis):
    dp, tp, pp = shape
    world = dp * tp * pp
    groups = Topology(dp, tp, pp).groups_of(axis)
    flat = [r for g in groups for r in g]
    assert sorted(flat) == list(range(world))  # disjoint and covering
    assert all(len(g) == getattr(Topology(dp, tp, pp), axis) for g in groups)
    assert len(groups) == world // getattr(Topology(dp, tp, pp), axis)
    # identical on every rank, and each rank's own group is one of them, in axis order
    for r in range(world):
        t = Topology(dp, tp, pp, rank=r)
        assert t.groups_of(axis) == groups
        mine = t.ranks_of(axis)
        assert mine in groups and r in mine
        assert [getattr(t.coords_of(x), axis) for x in mine] == list(range(len(mine)))
        # members differ from r only along `axis`
        for x in mine:
            a, b = t.coords_of(x)._asdict(), t.coords._asdict()
            a.pop(axis), b.pop(axis)
            assert a == b


@pytest.mark.parametrize("shape", SHAPES)
def test_coords_round_trip(shape):
    dp, tp, pp = shape
    seen = set()
    for r in range(dp * tp * pp):
        t = Topology(dp, tp, pp, rank=r)
        c = t.coords
        assert t.rank_of(dp=c.dp, tp=c.tp, pp=c.pp) == r
        assert t.coords_of(r) == c
        seen.add(c)
    assert seen == {
        Coords(p, d, x) for p, d, x in itertools.product(range(pp), range(dp), range(tp))
    }


def test_pipeline_neighbours():
    # dp=2, tp=1, pp=3: stages of dp replica 0 are ranks 0, 2, 4
    first, mid, last = (Topology(2, 1, 3, rank=r) for r in (0, 2, 4))
    assert first.is_first_stage and not first.is_last_stage
    assert (first.pp_prev, first.pp_next) == (None, 2)
    assert (mid.pp_prev, mid.pp_next) == (0, 4)
    assert not mid.is_first_stage and not mid.is_last_stage
    assert (last.pp_prev, last.pp_next) == (2, None)
    assert last.is_last_stage
    single = Topology(4)
    assert single.is_first_stage and single.is_last_stage
    assert (single.pp_prev, single.pp_next) == (None, None)


def test_ring_wraps_around():
    t = Topology(3, 2, 1, rank=5)  # dp group [1, 3, 5], tp group [4, 5]
    assert t.dp_ranks == [1, 3, 5]
    assert (t.ring_next("dp"), t.ring_prev("dp")) == (1, 3)
    assert (t.ring_next("tp"), t.ring_prev("tp")) == (4, 4)
    assert t.ring_next("pp") == t.ring_prev("pp") == 5  # size-1 axis: itself
    t0 = Topology(1, 1, 5, rank=0)
    assert (t0.ring_next("pp"), t0.ring_prev("pp")) == (1, 4)


def test_describe():
    text = Topology(2, 2, 2, rank=5).describe()
    assert "dp=2 tp=2 pp=2" in text and "world size 8" in text
    assert "[[4, 5], [6, 7]]" in text and "this rank 5: pp=1 dp=0 tp=1" in text
    assert len(text.splitlines()) >= 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dp=2, tp=2, world_size=6), r"2\*2\*1 = 4 does not equal the world size 6.*dp=6"),
        (dict(dp=2, tp=2, pp=2, world_size=7), r"= 8 does not equal the world size 7"),
        (dict(dp=2, rank=2), r"rank 2 is out of range \[0, 2\)"),
        (dict(dp=2, rank=-1), r"rank -1 is out of range"),
        (dict(dp=0), r"dp must be >= 1"),
        (dict(tp=0), r"tp must be >= 1"),
        (dict(pp=-3), r"pp must be >= 1"),
        (dict(dp=1.5), r"dp must be an int"),
    ],
)
def test_invalid_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Topology(**kwargs)


def test_invalid_axis_and_coords():
    t = Topology(2, 2)
    with pytest.raises(ConfigError, match=r"unknown axis 'xp'.*'dp', 'tp', 'pp'"):
        t.groups_of("xp")
    assert t.groups_of("ep") == [[0], [1], [2], [3]]  # ep = 1: every rank holds every expert
    with pytest.raises(ConfigError, match="unknown axis"):
        t.ring_next("x")
    with pytest.raises(ConfigError, match=r"tp coordinate 2 is out of range \[0, 2\)"):
        t.rank_of(tp=2)
    with pytest.raises(ConfigError, match=r"pp coordinate 1 is out of range"):
        t.rank_of(pp=1)


def test_groups_only_on_from_world():
    t = Topology(2, 2)
    for name in ("dp_group", "tp_group", "pp_group"):
        with pytest.raises(ConfigError, match=f"{name} exists only on a Topology built with"):
            getattr(t, name)


def test_from_world_requires_init():
    import torch.distributed as dist

    if dist.is_initialized():  # pragma: no cover - only if another test leaked a group
        pytest.skip("a default process group is already initialised in this process")
    with pytest.raises(ConfigError, match=r"distrain\.runtime\.init\(\).*distrain\.spawn"):
        Topology.from_world(dp=2)


# ---- from_world on 4 real ranks -------------------------------------------------------


def _worker(rank: int, port: int, world_size: int) -> None:
    """One rank: build from_world(dp=2, tp=2), all-reduce the rank over each group.

    Any failure raises, which gives the process a non-zero exit code for the parent.
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        topo = Topology.from_world(dp=2, tp=2, backend_timeout=timedelta(seconds=60))
        assert topo.rank == rank and topo.world_size == world_size
        assert topo == Topology(2, 2, 1, rank=rank)  # groups do not take part in equality
        for axis in ("tp", "dp", "pp"):
            group = getattr(topo, f"{axis}_group")
            expected = topo.ranks_of(axis)
            assert dist.get_world_size(group) == len(expected), axis
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            assert t.item() == sum(expected), (axis, rank, t.item(), expected)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_from_world_four_ranks_gloo():
    import torch.multiprocessing as mp

    world_size = 4
    port = free_port()  # one port for all ranks: they rendezvous there
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_worker, args=(r, port, world_size), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 90  # one shared budget: never hang on a deadlocked peer
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [r for r, p in enumerate(procs) if p.is_alive()]
        codes = {r: p.exitcode for r, p in enumerate(procs)}
        assert not stuck, f"ranks {stuck} still running after 90 s"
        assert all(c == 0 for c in codes.values()), f"rank exit codes: {codes}"
    finally:
        for p in procs:  # kill whatever is left so a failure cannot leave orphans
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
