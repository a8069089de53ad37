"""What the elastic guard does per step, made cheaper: rank 0's store round trips asked at the step's start
on a thread of their own (Member.begin / Member._flag), and a ZeRO rank's per-step piece packed from the
live state (GridEngine.piece_state) instead of a copy of it with its naming record made again."""

from __future__ import annotations

import pytest

from conftest import run_ranks


def test_rank_0_writes_the_step_and_asks_for_a_change_at_the_steps_start_and_the_quorum_takes_that_answer():
    import torch.distributed as dist

    from distrain.elastic.member import Member
    from distrain.elastic.protocol import key

    store = dist.HashStore()
    m = Member(store, 0, "gloo", 30.0)
    m.epoch, m.rank, m.world = 0, 0, 2
    try:
        m.begin(3, None)
        assert m.asked[:2] == (0, 3)
        assert m._flag(3) == 0.0  # (no change wanted when step 3 started)
        assert store.get(key("step")) == b"3"  # (written before the answer: the thread runs in order)
        m.updated(3)
        m.begin(4, None)
        m.asked[2].result()  # (answered)
        store.set(key("change", 0), "1")  # wanted once step 4 is under way: seen at step 5
        assert m._flag(4) == 0.0
        m.updated(4)
        m.begin(5, None)
        assert m._flag(5) == 1.0
        assert store.get(key("step")) == b"5"
        assert m.asked is None  # (taken)
        assert m._flag(5) == 1.0  # not asked at this step's start (here: taken already): asked now
        m.epoch = 1  # an answer of another epoch is never taken
        m.begin(6, None)
        m.epoch = 2
        assert m._flag(6) == 0.0  # (change/2 does not exist)
    finally:
        m.close()


def test_a_non_zero_rank_asks_nothing():
    from distrain.elastic.member import Member

    m = Member(None, 1, "gloo", 30.0)  # (no store: any use of it would fail)
    m.epoch, m.rank, m.world = 0, 1, 2
    m.begin(0, None)
    assert (m.asker, m.asked, m._flag(0)) == (None, None, 0.0)


def _same_tree(a, b, where="") -> list[str]:
    import torch

    if torch.is_tensor(a) or torch.is_tensor(b):
        if not (torch.is_tensor(a) and torch.is_tensor(b)):
            return [f"{where}: a tensor on one side only"]
        if (a.dtype, a.shape) != (b.dtype, b.shape) or not torch.equal(a, b):
            return [f"{where}: tensors differ"]
        return []
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b) if isinstance(b, dict) else type(b).__name__}"]
        return [p for k in a for p in _same_tree(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{where}: {type(a).__name__} of {len(a)} != {b!r:.40}"]
        return [p for i, (x, y) in enumerate(zip(a, b)) for p in _same_tree(x, y, f"{where}/{i}")]
    return [] if a == b else [f"{where}: {a!r:.40} != {b!r:.40}"]


def _piece_state_is_the_state_dict_of_live_tensors(rank: int) -> list[str]:
    return [f"{stage}: {p}" for stage in ("zero2", "zero3") for p in _piece_state_of(rank, stage)]


def _piece_state_of(rank: int, stage: str) -> list[str]:
    import torch

    from distrain.elastic.pieces import leaves, pack, rebuild_tree
    from distrain.models.registry import build_model
    from distrain.trainer.config import TrainConfig
    from distrain.trainer.engines import build_engine
    from distrain.trainer.task import lm_loss

    torch.manual_seed(0)
    cfg = TrainConfig(model="gpt-tiny", strategy=stage, nproc=2, batch_size=4, lr=1e-2, dtype="float64")
    e = build_engine(cfg, build_model("gpt-tiny").double(), lm_loss,
                     lambda p: torch.optim.AdamW(p, lr=1e-2))
    g = torch.Generator().manual_seed(rank)
    bad = []
    for step in range(2):  # (after each step: the optimizer's state changes, the piece follows it)
        x = torch.randint(0, 256, (2, 16), generator=g)
        e.train_step(x, torch.roll(x, -1, 1))
        piece, whole = e.piece_state(), e.state_dict()
        flat = []
        leaves(piece, flat)  # (the tree the pieces' functions see: its Fixed parts as their plain values)
        bad += [f"step {step}: {p}" for p in _same_tree(rebuild_tree(piece, iter(flat)), whole)]
        live = {t.data_ptr() for t in e.pm.zero.parameters()}
        if {t.data_ptr() for t in piece["zero"]["shards"]} != live:
            bad.append(f"step {step}: the piece's shards are not the live ones")
        if {t.data_ptr() for t in whole["zero"]["shards"]} & live:
            bad.append(f"step {step}: state_dict() shares the live shards (it copies them)")
        _, packed = pack(piece)  # what Member.begin keeps: equal to the state, in a buffer of its own
        bad += [f"step {step}, packed: {p}" for p in _same_tree(packed, whole)]
    return bad


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_zero_piece_state_is_the_state_dict_tree_with_the_live_tensors():
    run_ranks(_piece_state_is_the_state_dict_of_live_tensors, 2)


def test_the_asker_runs_calls_in_order_and_hands_back_their_results_and_errors():
    from distrain.elastic.asker import Asker

    seen, a = [], Asker()
    try:
        first = a.submit(seen.append, 1)
        boom = a.submit(int, "x")
        last = a.submit(lambda: tuple(seen))
        assert first.result(10) is None and last.result(10) == (1,)
        with pytest.raises(ValueError):  # (int("x")'s own error, raised where the result is taken)
            boom.result(10)
    finally:
        a.stop()


def test_bench_elastic_without_faults_reports_the_steady_state_only():
    from distrain.bench.elastic import cost
    from distrain.errors import ConfigError

    s = cost.Settings(nproc=2, strategy="zero2", model="gpt-tiny", steps=8, kill_step=0, faults=False)
    cost.check(s)  # (--kill-step is not checked: no kill runs)
    records = [{"what": "steady", "round": 0, "kind": "fixed", "step_s": 0.040},
               {"what": "steady", "round": 0, "kind": "elastic", "step_s": 0.042},
               {"what": "ratio", "round": 0, "elastic_over_fixed": 1.05}]
    m = cost.summarize(records)
    assert m == {"ratio_median": 1.05, "ratios": [1.05], "fixed_step_s": 0.040, "elastic_step_s": 0.042}
    lines = cost.format_report(s, m).splitlines()
    assert [ln.split("  ")[1] for ln in lines[1:]] == [
        "per step, fixed / elastic (medians)", "elastic / fixed, per round", "elastic / fixed, median"]
    with pytest.raises(ConfigError):  # with the kill runs, the same --kill-step is refused
        cost.check(cost.Settings(nproc=2, strategy="zero2", steps=8, kill_step=0))


def _affinity(ident: int) -> list[int]:
    import os

    return sorted(os.sched_getaffinity(0))


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="binds a core per rank: needs 2 cores")
def test_an_elastic_job_binds_its_ranks_to_cores_of_their_own_as_a_fixed_one_does():
    """A fixed shm job's ranks get cores of their own (spawn's bind_cores); an elastic job's did not, which
    made every elastic / fixed comparison on shm a comparison of bound against unbound ranks too."""
    import os

    from distrain.elastic import coordinator

    cores = sorted(os.sched_getaffinity(0))
    bound, _, _ = coordinator.run(_affinity, 2, 1, 2, bind_cores=True, timeout=60, collective_timeout=10)
    assert bound == {0: cores[:len(cores) // 2], 1: cores[len(cores) // 2:len(cores) // 2 * 2]}
    free, _, _ = coordinator.run(_affinity, 2, 1, 2, bind_cores=False, timeout=60, collective_timeout=10)
    assert free == {0: cores, 1: cores}


def test_a_newcomer_takes_the_cores_of_a_rank_that_is_gone_and_none_while_every_slot_is_held():
    from distrain.elastic.coordinator import Coordinator

    c = Coordinator(_affinity, (), 2, 1, 2, 0, "gloo", None, 10.0)
    c.slices = [[0], [1]]
    assert (c._cores(0), c._cores(1)) == ([0], [1])
    assert c._cores(2) is None  # (0 and 1 still run: a newcomer beside them is left to the scheduler)
    c.gone.add(0)
    assert c._cores(3) == [0]  # (rank id 0's slot, free once its process ended)
    assert c.slot == {0: 0, 1: 1, 3: 0}


def _pair():
    """Two InPlace ends over ordinary tensors: ``peer``'s buffers are what ``me`` maps (as symmetric memory
    gives it), for a piece of two tensors (the shape of a ZeRO piece: a flat shard and a moment)."""
    import torch

    from distrain.elastic.pieces import HEAD, InPlace, packed_size

    piece = {"shards": [torch.zeros(100)], "state": {"exp_avg": torch.zeros(37, dtype=torch.float64)}, "rank": 0}
    n = packed_size(piece)
    peer_bufs = [torch.zeros(HEAD + n, dtype=torch.uint8) for _ in range(2)]
    me, peer = InPlace(source=1), InPlace(source=0)
    peer.gens = [dict(bufs=peer_bufs, peers=[torch.zeros(HEAD + n, dtype=torch.uint8)] * 2, views=None, parity=0)]
    me.gens = [dict(bufs=[torch.zeros(HEAD + n, dtype=torch.uint8) for _ in range(2)], peers=peer_bufs, views=None,
                    parity=0)]
    return me, peer, piece


def _piece(step: int):
    import torch

    g = torch.Generator().manual_seed(step)
    return {"shards": [torch.randn(100, generator=g)],
            "state": {"exp_avg": torch.randn(37, generator=g, dtype=torch.float64)}, "rank": 1}


@pytest.mark.parametrize("kernels", ["python", "compiled"])
def test_an_in_place_replica_is_a_whole_steps_piece_never_half_of_two(kernels):
    """pieces.InPlace: the previous rank's piece read from its buffers (symmetric memory) only when the group
    breaks. A buffer never packed holds nothing (zeros are no step); a rank killed while packing step 4 leaves
    step 3's whole piece (the other parity) and nothing of 4; once 4 is packed both are offered, bit for bit.
    The pack's copy by torch (the Python kernels) and by the data plane's non-temporal stores alike."""
    from distrain.comm.shm import compiled

    if kernels == "compiled" and compiled.ext is None:
        pytest.skip(str(compiled.MISSING))
    before = compiled.kernels()
    compiled.set_kernels(kernels)
    try:
        _in_place_replica_is_whole()
    finally:
        compiled.set_kernels(before)


def _in_place_replica_is_whole():
    import torch

    from distrain.elastic.pieces import HEAD, leaves

    def flat(tree):
        out = []
        leaves(tree, out)
        return out

    me, peer, mine = _pair()
    assert me.replicas() == []  # (nothing packed yet on this side: no layout)
    me.pack(3, mine)
    assert me.replicas() == []  # (the peer's buffers are new: stamps 0, no step)
    peer.pack(3, _piece(3))
    (step, tree), = me.replicas()
    assert step == 3 and _same_tree(tree["shards"], _piece(3)["shards"]) == [] and \
        _same_tree(tree["state"], _piece(3)["state"]) == [] and tree["rank"] == 0  # (our labels: the caller's to fix)
    # killed while packing step 4 into the other buffer: the start stamp moved, the end stamp cleared, half copied
    buf = peer.gens[-1]["bufs"][4 % 2]
    head = buf[:16].view(torch.int64)
    head[1], head[0] = 0, 5
    buf[HEAD:HEAD + 200] = 7
    assert [s for s, _ in me.replicas()] == [3]
    peer.pack(4, _piece(4))
    got = dict(me.replicas())
    assert sorted(got) == [3, 4]
    for s in (3, 4):
        assert [torch.equal(a, b) for a, b in zip(flat(got[s]), flat(_piece(s)))] == [True, True]
    # a pack that started again over step 3's buffer while the reader copied: the start stamp no longer matches
    buf = peer.gens[-1]["bufs"][3 % 2]
    buf[:16].view(torch.int64)[0] = 6
    assert sorted(dict(me.replicas())) == [4]


def _in_place_over_shm(rank: int) -> list[str]:
    import torch

    from distrain import comm
    from distrain.elastic.pieces import InPlace, packed_size

    comm.set_transport("shm")
    bad = []
    small = {"shards": [torch.full((10,), float(rank))], "state": {}}
    big = _piece(10 + rank)  # (the optimizer's state appears at the first step: the piece grows)
    ip = InPlace.open(packed_size(small), (rank - 1) % 2)
    if ip is None:
        return ["no symmetric memory over --transport shm on one host"]
    ip.pack(0, small)
    ip.pack(1, big)
    comm.barrier()
    got = dict(ip.replicas())
    theirs = _piece(10 + (rank - 1) % 2)
    if sorted(got) != [0, 1]:
        bad.append(f"replicas of steps {sorted(got)}, [0, 1] expected")
    elif not (torch.equal(got[0]["shards"][0], torch.full((10,), float((rank - 1) % 2))) and
              _same_tree(got[1]["shards"], theirs["shards"]) == [] and _same_tree(got[1]["state"], theirs["state"]) == []):
        bad.append("a replica differs from the peer's piece")
    comm.barrier()  # (the peer's buffers stay mapped while the group lives)
    return bad


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_over_shm_the_in_place_replica_is_the_previous_ranks_piece_across_a_size_change():
    run_ranks(_in_place_over_shm, 2)


def test_a_fixed_part_of_a_piece_is_never_walked_and_its_plain_value_is_in_every_tree_made():
    """pieces.Fixed (an engine's naming record, the same every step): no tensor of it is packed or counted,
    and what pack, rebuild_tree and clone_tree make holds its value itself (no Fixed leaves the engine's tree)."""
    import torch

    from distrain.elastic.pieces import Fixed, clone_tree, leaves, pack, packed_size

    names = {"a.weight": "layers.0.a.weight", "shapes": [[2, 3]]}
    piece = {"zero": {"shards": [torch.arange(6.0)], "layout": Fixed({"units": [names]})}, "names": Fixed(names)}
    flat = []
    leaves(piece, flat)
    assert len(flat) == 1 and packed_size(piece) == 64
    _, packed = pack(piece)
    assert packed["names"] is names and packed["zero"]["layout"] == {"units": [names]}
    assert torch.equal(packed["zero"]["shards"][0], torch.arange(6.0))
    copy = clone_tree(piece)
    assert copy["names"] is names and type(copy["zero"]["layout"]) is dict


def test_an_in_place_pack_makes_its_views_once_per_buffer_and_anew_when_the_pieces_shapes_change():
    """pieces.InPlace.pack keeps each buffer's views (making them cost as much as the copy): steps of one parity
    pack into the same view tensors, the other parity into its own; a piece of the same bytes cut into other
    shapes gets new views, and the replica read back is still each step's piece, bit for bit."""
    import torch

    from distrain.elastic.pieces import leaves

    def flat(tree):
        out = []
        leaves(tree, out)
        return out

    me, peer, mine = _pair()
    me.pack(3, mine)  # (the reader's own layout: a replica takes its views' shapes, as the group's pieces share them)
    trees = {s: peer.pack(s, _piece(s)) for s in (3, 4, 5)}
    assert [a is b for a, b in zip(flat(trees[3]), flat(trees[5]))] == [True, True]  # (parity 1: one set of views)
    assert not any(a is b for a, b in zip(flat(trees[4]), flat(trees[5])))
    got = dict(me.replicas())
    assert sorted(got) == [4, 5]
    assert all(torch.equal(a, b) for s in (4, 5) for a, b in zip(flat(got[s]), flat(_piece(s))))
    g = torch.Generator().manual_seed(6)  # the same 400 + 296 bytes, other shapes: new views, the right bytes
    other = {"shards": [torch.randn(10, 10, generator=g)],
             "state": {"exp_avg": torch.randn(37, generator=g, dtype=torch.float64)}, "rank": 1}
    tree = peer.pack(7, other)
    assert tree["shards"][0].shape == (10, 10) and tree["shards"][0] is not trees[5]["shards"][0]
    assert [torch.equal(a, b) for a, b in zip(flat(tree), flat(other))] == [True, True]
    got = dict(me.replicas())
    assert sorted(got) == [4, 7]
    assert [torch.equal(a.flatten(), b.flatten()) for a, b in zip(flat(got[7]), flat(other))] == [True, True]
