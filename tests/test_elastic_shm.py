"""Elastic jobs on the shared-memory transport (--elastic MIN:MAX --transport shm, one host).

Each membership epoch's group gets a fresh shm transport (segments named per process, group and epoch);
a group that lost a member is broken by its survivors' watchdog (Member._interrupt: Gloo's sockets shut
down and every segment's ABORT line raised), so a survivor's shared-memory wait ends with the
PeerLostError the guard recovers from. Faults are real SIGKILLs (DISTRAIN_ELASTIC_FAULTS, as
tests/test_elastic.py). Losses are compared with the single-process run of the same job in fp64 (equal
to rounding: the shm all-reduce sums in another order than one process does), with test_elastic.py's
strictness, and so are the final weights. After every run no file of the transport is left in /dev/shm.
"""

from __future__ import annotations

import os

import pytest

from conftest import consolidated_state, init_raw_rank, raw_ranks, shm_files_of, trainer_config

RTOL = 1e-12  # tests/test_elastic.py's: fp64 losses equal to rounding
# the final weights, |a - b| <= ATOL + WEIGHTS_RTOL * |b| (weights of order 0.01-1; measured: 1.5e-13 at most).
# An absolute term because the attention's key biases get a gradient that is zero in exact arithmetic (a
# shift of every score of a query by the same amount leaves its softmax unchanged): Adam turns the rounding
# noise into tiny steps whose relative difference between two summation orders means nothing.
WEIGHTS_RTOL, ATOL = 1e-9, 1e-12


def shm_files() -> set[str]:
    """The transport's files in /dev/shm now (segments, symmetric allocations, wake-up FIFOs)."""
    from distrain.comm.shm import files

    return {n for n in os.listdir(files.SHM_DIR) if n.startswith(files.PREFIX)}


def run(tmp_path, monkeypatch, faults: str, **kw):
    """An elastic gpt-tiny job on --transport shm; returns (step losses, membership lines, summary or error)."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_events, read_metrics

    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", faults)
    cfg = trainer_config(tmp_path / "run", **{"strategy": "ddp", "collective_timeout": 30, "report": False,
                                              "transport": "shm", **kw})
    try:
        result = train(cfg)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        result = e
    path = tmp_path / "run" / "metrics.jsonl"
    return [r["loss"] for r in read_metrics(path)], read_events(path), result


_SINGLE: dict = {}


def single(tmp_path_factory, **kw) -> tuple[list[float], dict]:
    """The single-process run of ``trainer_config(**kw)``: (losses, final consolidated state), once a session."""
    from conftest import train_losses

    key = tuple(sorted(kw.items()))
    if key not in _SINGLE:
        out = tmp_path_factory.mktemp("single")
        _SINGLE[key] = train_losses(trainer_config(out, **kw, strategy="single", nproc=1)), consolidated_state(out)
    return _SINGLE[key]


def assert_same_run(out, losses: list[float], ref: tuple[list[float], dict]) -> None:
    import torch

    want, state = ref
    assert len(losses) == len(want) and all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, want)), (losses, want)
    got = consolidated_state(out)["model"]
    assert got.keys() == state["model"].keys()
    far = [n for n in got if not torch.allclose(got[n], state["model"][n], rtol=WEIGHTS_RTOL, atol=ATOL)]
    assert far == [], far


def test_shm_is_taken_on_one_host_and_refused_over_several_nodes(tmp_path):
    from distrain.elastic import check, check_nodes
    from distrain.elastic.nodes import NodeSpec
    from distrain.errors import ConfigError

    for transport in ("shm", "auto"):
        cfg = trainer_config(tmp_path / "never", strategy="zero2", nproc=2, elastic="1:2", transport=transport)
        cfg.validate()
        assert check(cfg) == (1, 2)
        assert check_nodes(cfg, None) is None and check_nodes(cfg, NodeSpec(0, 1, "127.0.0.1", 29400)) is None
        with pytest.raises(ConfigError) as info:
            check_nodes(cfg, NodeSpec(1, 2, "127.0.0.1", 29400))
        assert str(info.value) == (f"--elastic over 2 nodes: --transport {transport} is not supported there (a group "
                                   f"spread over several hosts re-forms only through torch's connections); use "
                                   f"--transport torch, or run on one host")
    torch_cfg = trainer_config(tmp_path / "never", strategy="ddp", nproc=2, elastic="1:2", transport="torch")
    assert check_nodes(torch_cfg, NodeSpec(1, 2, "127.0.0.1", 29400)) is None
    assert not (tmp_path / "never").exists()


# -- the break of a group (comm.interrupt_group: what an elastic rank's watchdog does on a loss) --------------------

CASES = ("blocking", "p2p", "async")  # a blocking all_reduce, a receive, an async all_reduce on the group's worker


def _interrupted(rank: int, port: int, world: int, out_dir: str, kernels: str) -> None:
    """Rank 1 blocks in a call on a group whose peer (rank 0) is alive but never comes; the group is broken
    under it (another thread, as the watchdog does; for the async call, close_group, as the elastic rank's
    leaving does). Then rank 0 calls into each group, twice. Each writes "<case> <error type> <seconds>" lines."""
    import threading
    import time

    import torch
    import torch.distributed as dist

    from distrain import comm

    init_raw_rank(rank, port, world, kernels)
    groups = [dist.new_group([0, 1]) for _ in CASES]
    t = torch.ones(1 << 16)
    for g in groups:  # every segment mapped, the compiled plane and its fast path in place
        comm.all_reduce(t, group=g)
        comm.all_reduce(t, group=g)
    flag, lines = os.path.join(out_dir, "rank1-done"), []
    if rank == 1:
        for case, g in zip(CASES, groups):
            t0 = time.monotonic()
            try:
                if case == "async":
                    h = comm.all_reduce(t, group=g, async_op=True)
                    time.sleep(0.5)
                    comm.close_group(g)  # the worker's wait is interrupted and drained before the unmapping
                    h.wait()
                else:
                    threading.Timer(0.5, comm.interrupt_group, [g]).start()
                    if case == "p2p":
                        comm.irecv(torch.empty(16), src=0, group=g).wait()
                    else:
                        comm.all_reduce(t, group=g)
                lines.append(f"{case} none {time.monotonic() - t0 - 0.5:.3f}")
            except Exception as e:  # noqa: BLE001 - written for the test
                lines.append(f"{case} {type(e).__name__} {time.monotonic() - t0 - 0.5:.3f}")
        open(flag, "w").close()
    else:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.05)
        for case, g in zip(CASES, groups):
            t0 = time.monotonic()
            try:  # (the first may complete on what rank 1 posted before the break; the second waits for it)
                comm.all_reduce(t, group=g)
                comm.all_reduce(t, group=g)
                lines.append(f"{case} none {time.monotonic() - t0:.3f}")
            except Exception as e:  # noqa: BLE001
                lines.append(f"{case} {type(e).__name__} {time.monotonic() - t0:.3f}")
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write("\n".join(lines))
    os._exit(0)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernels", ["compiled", "python"])
def test_an_interrupted_group_ends_every_wait_on_it_at_once_with_peer_lost(tmp_path, kernels):
    from distrain.comm.shm import compiled

    if kernels == "compiled" and compiled.ext is None:
        pytest.skip(str(compiled.MISSING))
    procs = raw_ranks(_interrupted, 2, tmp_path, kernels)
    assert [p.exitcode for p in procs] == [0, 0]
    for r in (0, 1):  # (the groups' time-out is 60 s: each wait ended by the break, within a few blocks)
        got = [ln.split() for ln in (tmp_path / f"rank{r}").read_text().splitlines()]
        assert [(c, kind) for c, kind, _ in got] == [(c, "PeerLostError") for c in CASES], (r, got)
        assert all(float(s) < 5 for _, _, s in got), (r, got)
    assert shm_files_of(procs) == []


@pytest.fixture
def no_leftovers():
    """The test's run leaves no file of the transport in /dev/shm (others' files, there before, aside)."""
    before = shm_files()
    yield
    assert shm_files() - before == set()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy, step, rolled_back, state_from", [
    ("ddp", 2, 2, "peers"),  # the step under way is redone from the survivors' start-of-step state
    ("zero2", 1, 1, "replicas"),  # id 1's piece of step 2 died with it; its copy of step 1 is on id 2
    ("zero3", 1, 1, "replicas"),  # (the same, read in place from id 1's symmetric memory: pieces.InPlace)
])
def test_sigkill_one_of_three_goes_on_at_two_with_the_same_losses_and_weights(
        tmp_path, tmp_path_factory, monkeypatch, no_leftovers, strategy, step, rolled_back, state_from):
    losses, events, summary = run(tmp_path, monkeypatch, "1@2", nproc=3, elastic="2:3", strategy=strategy)
    assert isinstance(summary, dict), summary
    assert_same_run(tmp_path / "run", losses, single(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"], e.get("state_from")) == \
           (3, 2, [1], step, rolled_back, state_from)
    assert summary["world_final"] == 2 and summary["ranks_left"] == 1


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_replacement_joins_over_shm_with_the_same_losses_and_weights(tmp_path, tmp_path_factory, monkeypatch,
                                                                       no_leftovers):
    # id 1 dies at step 2; its replacement (id 3) joins in the loss's change when it is ready by then (3 -> 3),
    # else in a change of its own while id 0 holds step 4 (3 -> 2 -> 3); it is healed from a peer over shm
    losses, events, summary = run(tmp_path, monkeypatch, "1@2,0@4:hold", nproc=3, elastic="2:3", elastic_replace=1,
                                  steps=6)
    assert isinstance(summary, dict), summary
    assert_same_run(tmp_path / "run", losses, single(tmp_path_factory, steps=6))
    assert [i for e in events for i in e["left"]] == [1] and [i for e in events for i in e["joined"]] == [3]
    assert events[0]["old_world"] == 3 and events[-1]["new_world"] == 3 and len(events) in (1, 2), events
    assert summary["world_final"] == 3 and summary["ranks_joined"] == 1


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_frozen_rank_breaks_the_shm_group_well_before_the_time_out(tmp_path, tmp_path_factory, monkeypatch,
                                                                      no_leftovers):
    # id 1 SIGSTOPs itself at step 2, its segment mapped and its lock held (it looks alive to the waits): the
    # coordinator sees its heartbeat stop (FROZEN_S) and ends the epoch; the survivors' watchdogs raise the
    # group's ABORT lines, so their waits end now rather than at --collective-timeout 60
    losses, events, summary = run(tmp_path, monkeypatch, "1@2:stop", nproc=3, elastic="2:3", collective_timeout=60)
    assert isinstance(summary, dict), summary
    assert_same_run(tmp_path / "run", losses, single(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"]) == (3, 2, [1], 2)
    assert e["recover_s"] < 30, e
