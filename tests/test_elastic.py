"""Elastic training (--elastic MIN:MAX, distrain/elastic): ranks lost and gained without a restart.

Faults are real signals: DISTRAIN_ELASTIC_FAULTS="ID@STEP" makes the process with that id SIGKILL
itself at the start of STEP (its peers are then mid-step: the step is cut in half and redone);
"ID@STEP:hold" holds that step until a newcomer is ready, so that it joins at a known step;
"ID@STEP:heal" SIGKILLs it in a newcomer's heal; "ID@STEP:stale" freezes it until the group went on.
Losses are compared with the single-process run of the same job (fp64: equal to rounding), the
exact form of "equal to a run started from the same state at the new world size" for a data-
parallel job (the slow test checks that form literally, resuming a world-3 run from a checkpoint).
"""

from __future__ import annotations

import json

import pytest

from conftest import reference_losses, trainer_config

RTOL = 1e-12


def run(tmp_path, monkeypatch, faults: str, **kw):
    """An elastic gpt-tiny job; returns (step losses, membership/stop lines, summary or the error)."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_events
    from distrain.trainer.metrics import read_metrics

    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", faults)
    cfg = trainer_config(tmp_path / "run", **{"strategy": "ddp", "collective_timeout": 30, "report": False, **kw})
    try:
        result = train(cfg)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        result = e
    path = tmp_path / "run" / "metrics.jsonl"
    return [r["loss"] for r in read_metrics(path)], read_events(path), result


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(100)
def test_sigkill_one_of_four_finishes_at_three_with_the_same_losses(tmp_path, tmp_path_factory, monkeypatch):
    losses, events, summary = run(tmp_path, monkeypatch, "1@2", nproc=4, elastic="3:4", steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["event"], e["old_world"], e["new_world"], e["left"], e["joined"], e["step"], e["rolled_back"]) == \
           ("membership", 4, 3, [1], [], 2, 2)
    assert 0 < e["recover_s"] < 30
    assert summary["membership_changes"] == 1 and summary["world_final"] == 3 and summary["ranks_left"] == 1
    assert summary["world_start"] == 4  # (the table: "processes  4 at the start, 3 at the end (1 membership change)")
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("world") for r in rows if "event" not in r] == [4, 4, 3, 3, 3]


@pytest.mark.timeout(100)
def test_below_min_stops_cleanly_with_a_checkpoint_and_one_line(tmp_path, monkeypatch):
    from distrain.errors import TrainingError
    from distrain import checkpoint

    losses, events, err = run(tmp_path, monkeypatch, "1@2", nproc=3, elastic="3:3", steps=5, batch_size=12)
    assert isinstance(err, TrainingError), err
    msg = str(err)
    assert "\n" not in msg
    assert msg.startswith("elastic: stopped at step 2: 2 rank(s) left (rank id(s) 1 lost), fewer than MIN 3 of "
                          "--elastic 3:3; the checkpoint of step 2 is in "), msg
    assert checkpoint.read_manifest(tmp_path / "run")["step"] == 2
    assert len(losses) == 2
    assert [e["event"] for e in events] == ["stop"] and events[0]["new_world"] == 2


@pytest.mark.timeout(100)
def test_newcomer_joins_healed_from_a_peer_3_to_4(tmp_path, tmp_path_factory, monkeypatch):
    # rank id 0 holds step 2 until the replacement is ready: it joins at step 1, 2 or 3
    losses, events, summary = run(tmp_path, monkeypatch, "0@2:hold", nproc=3, elastic="3:4", elastic_replace=1,
                                  steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["joined"], e["rolled_back"]) == (3, 4, [], [3], None)
    assert 1 <= e["step"] <= 3
    assert e["join_s"] > 0 and summary["world_final"] == 4 and summary["ranks_joined"] == 1


@pytest.mark.timeout(100)
def test_console_says_each_change_and_the_table_the_world_at_start_and_end(tmp_path, monkeypatch, capfd):
    # id 1 SIGKILLs itself at step 2 (3 -> 2, step 2 redone); its replacement (id 3) joins while id 0 holds step 4
    from distrain.trainer.report import table_rows

    _, events, summary = run(tmp_path, monkeypatch, "1@2,0@4:hold", nproc=3, elastic="2:3", elastic_replace=1,
                             steps=6)
    assert isinstance(summary, dict), summary
    out = capfd.readouterr().out.splitlines()
    changes = [ln for ln in out if ln.startswith("distrain: elastic: rank id")]
    joined_at = events[1]["step"]
    assert changes == [
        "distrain: elastic: rank id 1 left (killed by SIGKILL); world 3 -> 2; rolled back to step 2 (the step under "
        "way is redone)",
        f"distrain: elastic: rank id 3 joined; world 2 -> 3; goes on from step {joined_at}"], out
    assert 2 <= joined_at <= 5  # (the hold at step 4 lets it in at step 3 or 4; a loaded host, 5)
    assert (summary["world_start"], summary["world_final"], summary["membership_changes"]) == (3, 3, 2)
    cfg = trainer_config(tmp_path / "run", strategy="ddp", nproc=3, elastic="2:3", steps=6)
    assert ("processes", "3 at the start, 3 at the end (2 membership changes)") in table_rows(cfg, summary, 0,
                                                                                                "tokens", [])


@pytest.mark.timeout(60)
def test_kill_during_a_heal_finishes_with_the_survivors_and_the_same_losses(tmp_path, tmp_path_factory, monkeypatch):
    # a replacement joins 3 -> 4 (id 0 holds step 2 until it is ready); id 1 SIGKILLs itself in that heal, just
    # before rank 0 sends the state: the change is retried and the job ends at 3 (0, 2 and the newcomer 3)
    losses, events, summary = run(tmp_path, monkeypatch, "0@2:hold,1@0:heal", nproc=3, elastic="2:4",
                                  elastic_replace=1, steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    # the heal that failed never completed a step: one line for the whole change, from the group of 3 that last
    # trained to the 3 it goes on with (id 1 left, the newcomer 3 joined; elastic/protocol.py whole_change)
    (e,) = events
    assert (e["event"], e["old_world"], e["new_world"], e["left"], e["joined"]) == ("membership", 3, 3, [1], [3])
    assert 1 <= e["step"] <= 3
    assert summary["world_final"] == 3 and summary["ranks_left"] == 1
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["world"] for r in rows if "event" not in r][-1] == 3


@pytest.mark.timeout(60)
def test_a_stale_rank_coming_back_is_refused_naming_its_step_and_the_groups(tmp_path, tmp_path_factory, monkeypatch,
                                                                            capfd):
    # id 1 goes silent at step 2; past --collective-timeout the others drop it and go on from step 2 at world 2;
    # id 0 holds step 4 until id 1, back with its state of step 2, has been refused
    losses, events, summary = run(tmp_path, monkeypatch, "1@2:stale,0@4:hold", nproc=3, elastic="2:3", steps=5,
                                  collective_timeout=2)
    assert isinstance(summary, dict), summary
    line = ("elastic: rank id 1 refused: its state is at step 2, the group's at step 4; it was dropped (silent past "
            "--collective-timeout) and cannot rejoin with a stale state")
    # the agent's log (the rank raises the same line and prints it as `distrain: error: ...` to its own stderr,
    # which capfd sees only when the forkserver was started in this test)
    out = capfd.readouterr().out
    assert f"distrain: {line}" in out.splitlines(), out
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    assert [(e["old_world"], e["new_world"], e["left"], e["step"]) for e in events] == [(3, 2, [1], 2)]


def _opens_the_metrics_log(rank: int, out: str) -> list[str]:
    import sys
    from pathlib import Path

    from distrain.trainer.metrics import MetricsLog

    before = set(sys.modules)
    MetricsLog(Path(out) / "metrics.jsonl", 0, tensorboard=True).tensorboard.close()
    return sorted(set(sys.modules) - before)


@pytest.mark.timeout(60)
def test_rank_0_opens_its_metrics_log_without_importing(tmp_path):
    """Rank 0 alone opens the metrics log (with TensorBoard) just before its first step, while the others already
    wait in the step's all-reduce: its import (0.25 s quiet, 2.2-2.6 s on 2 cores beside 5 busy processes) ran
    past --collective-timeout 2 in the stale-rank test above, a false loss (an extra change (3, 3, [], 0)). The
    fork server imports it (launch/warm.py): a rank opens the log importing nothing."""
    pytest.importorskip("torch.utils.tensorboard")
    import distrain

    (new,) = distrain.spawn(_opens_the_metrics_log, 1, args=(str(tmp_path),), timeout=45)
    assert new == [], f"opening the metrics log imported {len(new)} module(s) in a rank: {new[:8]}"


def test_the_refusal_of_another_runs_state_names_both_runs():
    from distrain.elastic.quorum import refusal

    assert refusal(2, {"live": 7, "snap": 6, "run": "aaaa"}, "bbbb", 3) == (
        "elastic: rank id 2 refused: its state is of run aaaa, the group's of run bbbb; a rank cannot join another run")
    assert refusal(2, {"live": None, "snap": 1, "run": "bbbb"}, "bbbb", 3) == (
        "elastic: rank id 2 refused: its state is at step 1, the group's at step 3; it was dropped (silent past "
        "--collective-timeout) and cannot rejoin with a stale state")
    assert refusal(1, {"live": None, "snap": 0, "run": "bbbb"}, "bbbb", None) == (
        "elastic: rank id 1 refused: its state is at step 0, the group's before its first completed step; it was "
        "dropped (silent past --collective-timeout) and cannot rejoin with a stale state")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_kill_twice_in_a_row_uneven_parts(tmp_path, tmp_path_factory, monkeypatch):
    # batch 8: 4 ranks take 2 each, 3 ranks take 3, 3 and 2 (scaled losses), 2 ranks 4 each
    losses, events, summary = run(tmp_path, monkeypatch, "1@2,2@3", nproc=4, elastic="2:4", steps=5, batch_size=8)
    assert isinstance(summary, dict), summary
    ref = reference_losses(tmp_path_factory, batch_size=8)
    assert close(losses, ref), (losses, ref)
    assert [(e["old_world"], e["new_world"], e["left"], e["step"]) for e in events] == [(4, 3, [1], 2), (3, 2, [2], 3)]
    assert summary["membership_changes"] == 2 and summary["world_final"] == 2


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_losses_after_the_change_equal_a_world_3_run_from_the_same_state(tmp_path, monkeypatch):
    """The literal form: a 4-rank DDP run to step 2 (its checkpoint), resumed at world size 3."""
    from conftest import train_losses

    losses, _, summary = run(tmp_path, monkeypatch, "3@2", nproc=4, elastic="3:4", steps=5)
    assert isinstance(summary, dict), summary
    out = tmp_path / "ref"
    before = train_losses(trainer_config(out, strategy="ddp", nproc=4, steps=2))
    after = train_losses(trainer_config(out, strategy="ddp", nproc=3, steps=5, resume=True, reshard=True))
    assert close(losses[:2], before) and close(losses[2:], after[2:]), (losses, before, after)


def test_part_bounds_cover_the_batch_and_match_the_sampler():
    from distrain.data import DistributedBatchSampler
    from distrain.data.sampler import part_bounds
    from distrain.elastic.faults import parse as parse_faults

    for batch in (8, 12, 13):
        for world in range(1, 6):
            parts = [part_bounds(batch, world, r) for r in range(world)]
            assert parts[0][0] == 0 and parts[-1][1] == batch
            assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert max(h - lo for lo, h in parts) - min(h - lo for lo, h in parts) <= 1
            if batch % world == 0:
                s = [DistributedBatchSampler(100, batch, dp_rank=r, dp_size=world) for r in range(world)]
                g = s[0].global_batch(3)
                assert all(g[lo:hi].tolist() == s[r].batch(3).tolist() for r, (lo, hi) in enumerate(parts))
    assert parse_faults("1@3, 2@5:stop,0@4:hold") == {(1, 3): "kill", (2, 5): "stop", (0, 4): "hold"}


@pytest.mark.parametrize("kw, message", [
    (dict(elastic="2:4", strategy="torch-ddp"),
     "--elastic 2:4: --strategy torch-ddp is not supported; elastic training needs a state that survives a lost rank "
     "(every rank's state held twice, none on the ranks that may go, or, with diloco, only an island's progress "
     "since the last outer step): use --strategy ddp or zero1 or zero2 or zero3 or ps-sync or diloco"),
    (dict(elastic="2:4", strategy="ps-async"),
     "--elastic 2:4: --strategy ps-async is not supported; elastic training needs a state that survives a lost rank "
     "(every rank's state held twice, none on the ranks that may go, or, with diloco, only an island's progress "
     "since the last outer step): use --strategy ddp or zero1 or zero2 or zero3 or ps-sync or diloco"),
    (dict(elastic="1:4", nproc=4, strategy="ps-sync"),
     "--elastic 1:4: MIN 1 leaves no worker beside the --servers 1 parameter server(s); use MIN >= 2"),
    (dict(elastic="3:2"),
     "--elastic 3:2: MIN 3 is larger than MAX 2; the job keeps between MIN and MAX ranks, so MIN <= MAX"),
    (dict(elastic="3:4", nproc=2),
     "--elastic 3:4: MIN 3 is larger than --nproc 2; the job would start below its minimum: use --nproc >= 3 or a "
     "smaller MIN"),
    (dict(elastic="2-4"),
     "--elastic '2-4' is malformed: give MIN:MAX, the fewest and the most ranks the job may run with, two whole "
     "numbers (e.g. --elastic 2:4)"),
    (dict(elastic="2:"),
     "--elastic '2:' is malformed: give MIN:MAX, the fewest and the most ranks the job may run with, two whole "
     "numbers (e.g. --elastic 2:4)"),
    (dict(elastic="0:2"), "--elastic 0:2: MIN must be at least 1 rank, got 0"),
    (dict(elastic="2:3", nproc=4), "--elastic 2:3: --nproc 4 is larger than MAX 3; use --nproc <= 3 or a larger MAX"),
    (dict(elastic_replace=1), "--elastic-replace 1 starts replacement ranks of an elastic job: it needs --elastic "
                              "MIN:MAX"),
    (dict(elastic="2:4", nproc=4, tp=2, strategy="zero1"),
     "--elastic 2:4: with --tp/--pp only --strategy ddp is supported (the dp dimension; a ZeRO piece would be lost "
     "with its replica); got --strategy zero1"),
    (dict(elastic="3:4", nproc=4, tp=2),
     "--elastic 3:4: MIN 3 is not a multiple of --tp 2 x --pp 1 = 2 ranks per model replica; the job gains and "
     "loses whole replicas"),
    (dict(elastic="2:4", nproc=4, tp=2, elastic_replace=1),
     "--elastic 2:4: --elastic-replace is not supported with --tp/--pp (a newcomer would have to bring a whole "
     "replica of 2 ranks at once); leave it out"),
    (dict(elastic="2:6", nproc=6, pp=2, microbatches=2, batch_size=8),
     "--elastic 2:6: --batch-size 8 does not split into 3 replica(s) x 2 micro-batch(es), a size the job may "
     "shrink to; use a batch size divisible by 2 x each of [1, 2, 3]"),
    (dict(elastic="2:4", dp=2), "--elastic 2:4: --dp is set by the number of live ranks in an elastic job; leave it "
                                "out"),
])
def test_bad_input_is_refused_before_start_with_the_rule(tmp_path, kw, message):
    from distrain.errors import ConfigError

    cfg = trainer_config(tmp_path / "never", **{"strategy": "ddp", "nproc": 2, **kw})
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert str(info.value) == message
    assert not (tmp_path / "never").exists()


def test_the_cli_refuses_before_start(tmp_path, capsys, monkeypatch):
    # the command's own entry (cli.main) in this process: a fresh interpreter only added torch's import
    # (`python -m distrain` itself: tests/test_first_contact.py::test_version_and_python_m)
    from distrain.cli import main

    out = tmp_path / "never"
    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", "")
    code = main(["train", "--elastic", "3:2", "--nproc", "2", "--model", "gpt-tiny", "--out", str(out)])
    assert code != 0
    assert "--elastic 3:2: MIN 3 is larger than MAX 2" in capsys.readouterr().err
    assert not out.exists()


# -- ps-sync: stateless workers come and go; the servers keep their shards ------------------------------------------

@pytest.mark.timeout(100)
def test_ps_sync_loses_a_worker_and_the_servers_keep_their_shards(tmp_path, tmp_path_factory, monkeypatch):
    # 3 workers (ids 0-2) and 1 server (id 3): worker id 1 dies at step 2; the server re-serves step 2 to 2 workers
    losses, events, summary = run(tmp_path, monkeypatch, "1@2", nproc=4, elastic="3:4", strategy="ps-sync")
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"]) == (4, 3, [1], 2, 2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_ps_sync_newcomer_joins_as_a_worker_and_a_lost_server_ends_the_job(tmp_path, tmp_path_factory, monkeypatch):
    # the newcomer (id 3) is placed before the server (id 2), so it works and the server keeps its index
    losses, events, summary = run(tmp_path, monkeypatch, "0@2:hold", nproc=3, elastic="3:4", elastic_replace=1,
                                  strategy="ps-sync")
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["joined"]) == (3, 4, [3])
    _, _, err = run(tmp_path / "server", monkeypatch, "3@2", nproc=4, elastic="3:4", strategy="ps-sync")
    assert str(err) == ("elastic: parameter server rank id(s) [3] lost; a server's shard of the weights and optimizer "
                        "has no copy, so ps-sync survives the loss of workers only, and the job ends"), err


# -- dp x tp x pp: the job loses whole model replicas ---------------------------------------------------------------

@pytest.mark.timeout(100)
def test_dp2_tp2_a_lost_rank_takes_its_replica_out_and_the_other_goes_on(tmp_path, tmp_path_factory, monkeypatch):
    # ids 0, 1 are replica 0 (tp ranks 0, 1), ids 2, 3 replica 1: id 1 dies, id 0 is ended with it, and
    # ids 2, 3 go on as dp1 x tp2 holding the same tp shards, with the whole global batch
    losses, events, summary = run(tmp_path, monkeypatch, "1@2", nproc=4, elastic="2:4", tp=2)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"]) == (4, 2, [0, 1], 2, 2)
    assert summary["world_final"] == 2


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dp2_pp2_replicas_are_found_on_the_pipeline_major_grid(tmp_path, tmp_path_factory, monkeypatch):
    # topology order: position = pp_rank * dp * tp + dp_rank * tp + tp_rank, so replica 0 is ids 0 and 2
    losses, events, summary = run(tmp_path, monkeypatch, "2@2", nproc=4, elastic="2:4", pp=2, microbatches=2)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    assert [(e["old_world"], e["new_world"], e["left"]) for e in events] == [(4, 2, [0, 2])]


def test_whole_replicas_follow_the_topology_order():
    from distrain.elastic.quorum import whole_replicas

    # dp3 x tp2: replicas {0,1} {2,3} {4,5}; dp2 x tp2 x pp2 (ids 10..17): replica 0 = 10, 11, 14, 15
    assert whole_replicas([0, 1, 2, 3, 4, 5], [0, 1, 2, 4, 5], 2, 1) == [0, 1, 4, 5]
    assert whole_replicas(list(range(10, 18)), [10, 11, 12, 13, 15, 16, 17], 2, 2) == [12, 13, 16, 17]


# -- sharded state (ZeRO): each rank's piece and a replica of its predecessor's ---------------------------------------

@pytest.mark.timeout(100)
def test_zero2_sigkill_one_of_four_goes_on_from_the_lost_ranks_replica(tmp_path, tmp_path_factory, monkeypatch):
    # id 1 dies at the start of step 2: its piece of step 2 is gone, its copy of step 1 is on id 2 (the replica),
    # so the group rolls back to step 1, gathers the four pieces of step 1 and cuts them for three ranks
    losses, events, summary = run(tmp_path, monkeypatch, "1@2", nproc=4, elastic="3:4", strategy="zero2")
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"], e["state_from"]) == \
           (4, 3, [1], 1, 1, "replicas")
    assert summary["world_final"] == 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_zero3_newcomer_gets_its_piece_cut_from_the_others_3_to_4(tmp_path, tmp_path_factory, monkeypatch):
    losses, events, summary = run(tmp_path, monkeypatch, "0@2:hold", nproc=3, elastic="3:4", elastic_replace=1,
                                  strategy="zero3")
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["joined"], e["rolled_back"], e["state_from"]) == \
           (3, 4, [3], None, "peers")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_zero1_a_rank_and_its_successor_lost_at_once_fall_back_to_the_checkpoint(tmp_path, tmp_path_factory,
                                                                                 monkeypatch):
    # ids 1 and 2 die at step 3 (a "node" of two neighbours): id 1's piece and its only copy (on id 2) are gone,
    # so the group goes on from the checkpoint of step 2; without a checkpoint the job stops, naming the piece
    losses, events, summary = run(tmp_path, monkeypatch, "1@3,2@3", nproc=4, elastic="2:4", strategy="zero1",
                                  ckpt_every=2)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["state_from"]) == (4, 2, [1, 2], 2, "checkpoint")
    _, _, err = run(tmp_path / "none", monkeypatch, "1@3,2@3", nproc=4, elastic="2:4", strategy="zero1", ckpt_every=0)
    assert str(err).startswith("elastic: the piece(s) of ZeRO rank(s) [1] of 4 were lost with their replicas (a rank "
                               "and its successor at once) and no checkpoint was written yet; the job cannot go on: "
                               "set --ckpt-every"), err


def _offer(live, snap, pieces, ckpt=None):
    return {"live": live, "snap": snap, "pieces": [list(p) for p in pieces], "ckpt": ckpt}


def test_the_sharded_target_is_the_latest_step_whose_pieces_make_a_whole():
    from distrain.elastic.quorum import sharded_target
    from distrain.errors import TrainingError

    # 4 ranks, id 1 lost after every rank finished step 4 (live 5): its piece of 5 is gone, of 4 on rank 2
    offers = {i: _offer(5, 4, [(5, 4, i, "own"), (4, 4, i, "own"), (4, 4, (i - 1) % 4, "replica")]) for i in (0, 2, 3)}
    assert sharded_target(offers) == (4, "replicas")
    # a newcomer joins (nobody lost): the live pieces of 5 are whole
    offers[1] = _offer(5, 4, [(5, 4, 1, "own"), (4, 4, 1, "own"), (4, 4, 0, "replica")])
    assert sharded_target(offers) == (5, "peers")
    # ids 1 and 2 lost at once: the piece of 1 is nowhere; the last checkpoint every survivor knows
    offers = {i: _offer(5, 4, [(5, 4, i, "own"), (4, 4, i, "own"), (4, 4, (i - 1) % 4, "replica")], ckpt=2)
              for i in (0, 3)}
    assert sharded_target(offers) == (2, "checkpoint")
    offers[3]["ckpt"] = None
    with pytest.raises(TrainingError, match=r"the piece\(s\) of ZeRO rank\(s\) \[1\] of 4 were lost"):
        sharded_target(offers)


def test_pieces_that_do_not_make_a_whole_are_named_by_layout():
    from distrain.errors import ConfigError
    from distrain.checkpoint.reshard import consolidate_pieces

    # (joining whole sets is checked by the elastic ZeRO runs above, equal to one process in fp64)
    with pytest.raises(ConfigError, match=r"do not make a whole \(held, by world size: \{4: \[0, 2, 3\]\}\)"):
        consolidate_pieces([(4, r, {}) for r in (3, 0, 2)], 7)


def test_the_node_spec_of_a_multi_node_job(monkeypatch):
    from distrain.cluster.runner import elastic_command
    from distrain.elastic import nodes
    from distrain.errors import ConfigError

    monkeypatch.setenv(nodes.ENV_NODES, "1/2@10.251.0.1:29400")
    monkeypatch.delenv("DISTRAIN_JOB_SECRET", raising=False)
    with pytest.raises(ConfigError, match=r"^DISTRAIN_ELASTIC_NODES is set \(an elastic job over several nodes\), but "
                                          r"DISTRAIN_JOB_SECRET is not: every node needs the job's secret"):
        nodes.from_env(4)
    monkeypatch.setenv("DISTRAIN_JOB_SECRET", "short")
    with pytest.raises(ConfigError, match=r"^DISTRAIN_JOB_SECRET holds 5 character\(s\); a job secret needs at least 32"):
        nodes.from_env(4)
    monkeypatch.setenv("DISTRAIN_JOB_SECRET", "c" * 64)
    spec = nodes.from_env(4)
    assert (spec.node, spec.nodes, spec.host, spec.port, spec.ids(4), spec.ids(4, 0)) == \
           (1, 2, "10.251.0.1", 29400, [2, 3], [0, 1])
    assert nodes.follower()
    with pytest.raises(ConfigError, match=r"--nproc 5 does not split evenly into them; give a multiple of 2"):
        nodes.from_env(5)
    monkeypatch.setenv(nodes.ENV_NODES, "2/2@h:1")
    with pytest.raises(ConfigError, match=r"node 2 is not one of 0..1"):
        nodes.from_env(4)
    monkeypatch.setenv(nodes.ENV_NODES, "0/2@h")
    with pytest.raises(ConfigError, match=r"is malformed: give NODE/NODES@HOST:PORT"):
        nodes.from_env(4)
    monkeypatch.setenv(nodes.ENV_NODES, "0/2@h:1")
    assert not nodes.follower()
    # cluster run: an elastic `distrain train` runs its own agents (with --nproc for every node), others torchrun
    assert elastic_command(["distrain", "train", "--elastic", "2:4"], 4) == ["train", "--elastic", "2:4", "--nproc", "4"]
    assert elastic_command(["distrain", "train", "--nproc", "4"], 4) is None


# -- replicated state commits before its update: no copy per step, a roll forward when one is due ------------------

@pytest.mark.timeout(100)
def test_a_rank_that_took_its_commit_for_lost_rolls_forward_with_the_same_losses(tmp_path, tmp_path_factory,
                                                                                  monkeypatch):
    # id 1's commit of step 2 completes, then it takes it for lost (test hook): the others applied step 2 and are
    # in step 3 when the group breaks; id 1 holds step 2's synchronised gradients, so it finishes step 2 alone
    # and the group goes on from step 3 (redoing step 3, cut in half), nobody lost
    losses, events, summary = run(tmp_path, monkeypatch, "1@2:commit-lost", nproc=3, elastic="2:3", steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["joined"], e["step"], e["rolled_back"], e["rolled_forward"]) \
        == (3, 3, [], [], 3, 3, 2)


@pytest.mark.timeout(100)
def test_a_kill_right_after_the_commit_redoes_nothing_of_that_step(tmp_path, tmp_path_factory, monkeypatch):
    # id 1 dies after its commit of step 2 (before its update): every other rank committed and applied step 2,
    # so the group goes on from step 3 at world 3 (step 3, under way when the loss was seen, is redone)
    losses, events, summary = run(tmp_path, monkeypatch, "1@2:commit", nproc=4, elastic="3:4", steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_forward"]) == (4, 3, [1], 3, None)


def _keep_after_a_lost_commit(rank: int) -> list[str]:
    """One rank: a DDP engine's step whose commit is taken for lost; what the guard keeps is the step's
    start (parameters, optimizer, buffers, RNG) and the step finished here."""
    import torch

    from distrain.elastic.member import Member
    from distrain.errors import PeerLostError
    from distrain.trainer.config import TrainConfig
    from distrain.trainer.engines import build_engine
    from distrain.trainer.guard import ElasticGuard

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm = torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(torch.nn.functional.dropout(self.lin(x), 0.5))

    def engine():
        torch.manual_seed(0)
        net = Net().double()
        return build_engine(TrainConfig(strategy="ddp", nproc=1, batch_size=8, lr=0.1),
                            net, torch.nn.functional.mse_loss, lambda p: torch.optim.AdamW(p, lr=0.1))

    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    ref = engine()
    ref.train_step(x, y)  # a warm step, so the optimizer has state
    before, rng_before = _tree(ref.state_dict()), torch.get_rng_state()
    ref.train_step(x, y)
    after, rng_after = _tree(ref.state_dict()), torch.get_rng_state()

    torch.set_rng_state(rng_before)
    e = engine()
    e.train_step(x, y)
    torch.set_rng_state(rng_before)
    q = Member(None, 0, "gloo", 30.0)
    q.world, q.live = 1, 1
    guard = ElasticGuard(None, q, None, None)
    guard.q.sharded = False
    q.hooks.at_step = lambda m, s: None
    guard.begin(1, e)

    class Lost:
        """The commit completes (the step's gradients are here), then this rank takes it for lost."""

        def values(self, loss):  # (riding with the gradients)
            return torch.zeros(2, dtype=torch.float64)

        def averaged(self, averages):
            q.ready = True
            raise PeerLostError("test: the commit's result never arrived")

        __call__ = averaged  # (its own all-reduce)
    try:
        e.train_step(x, y, Lost())
    except PeerLostError:
        pass
    held = guard.keep(e)
    bad = []
    if sorted(held) != [1, 2]:
        return [f"held steps {sorted(held)}"]
    for step, (want, rng) in {1: (before, rng_before), 2: (after, rng_after)}.items():
        got = _tree(held[step]["engine"])
        if got.keys() != want.keys() or any(not torch.equal(got[k], want[k]) for k in want):
            bad.append(f"step {step}: state differs at {[k for k in want if not torch.equal(got[k], want[k])][:3]}")
        if not torch.equal(held[step]["rng"], rng):
            bad.append(f"step {step}: RNG differs")
    return bad


def _tree(state, prefix="") -> dict:
    import torch

    out = {}
    if torch.is_tensor(state):
        out[prefix] = state.detach().clone()
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(_tree(v, f"{prefix}/{k}"))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            out.update(_tree(v, f"{prefix}/{i}"))
    return out


@pytest.mark.timeout(60)
def test_what_a_rank_keeps_after_a_lost_commit_is_the_steps_start_and_its_end():
    from conftest import run_ranks

    run_ranks(_keep_after_a_lost_commit, 1)


@pytest.mark.timeout(100)
def test_a_rank_that_missed_the_commit_gets_the_step_from_a_peer(tmp_path, tmp_path_factory, monkeypatch):
    # the commit of ddp rides with the last gradient bucket; id 1 takes step 2's for lost before it completes
    # there (test hook) while the others complete it and apply step 2: id 1 is a step behind, and gets step
    # 3's state from a peer when the group re-forms (nobody lost, no step redone but the one cut: step 3)
    losses, events, summary = run(tmp_path, monkeypatch, "1@2:commit-missed", nproc=3, elastic="2:3", steps=5)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory)), (losses, reference_losses(tmp_path_factory))
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"], e["rolled_forward"]) == \
        (3, 3, [], 3, 3, 2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("second", ["open", "load"])
def test_zero3_a_second_loss_while_the_group_reopens_waits_for_no_time_out(tmp_path, tmp_path_factory, monkeypatch,
                                                                            second):
    """Issue 39's hang: zero3 at P=4 lost rank id 2, then rank id 0 during the recovery, and the survivors waited
    for the group's time-out (300 s by default, the value here) in torch's rendezvous or in the new group's state
    gather. Now the job finishes with the single-process losses, every step's line, one change from 4 to 2
    (ids 2 and 0 left) that recovered in seconds."""
    losses, events, summary = run(tmp_path, monkeypatch, f"2@3,0@2:{second}", nproc=4, elastic="2:4",
                                  strategy="zero3", collective_timeout=300, steps=5, log_every=1)
    assert isinstance(summary, dict), summary
    assert close(losses, reference_losses(tmp_path_factory, log_every=1)), losses
    (e,) = events
    assert (e["old_world"], e["new_world"], sorted(e["left"]), e["joined"]) == (4, 2, [0, 2], [])
    assert e["recover_s"] < 30, e


@pytest.mark.timeout(150)
@pytest.mark.parametrize("log_every", [1, 3])
def test_rank_0_killed_leaves_every_committed_steps_line(tmp_path, tmp_path_factory, monkeypatch, log_every):
    """Before: rank 0 killed right after its commit of step 5 lost the lines it had not written yet (the others
    had dropped them at the same write point: step 5 missing with --log-every 1, steps 3-5 with 3). Now the next
    rank 0 writes them: every step's line, exactly once, with the single-process losses."""
    from distrain.trainer.metrics import read_metrics

    losses, events, summary = run(tmp_path, monkeypatch, "0@5:commit", nproc=4, elastic="2:4", steps=8,
                                  log_every=log_every)
    assert isinstance(summary, dict), summary
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == list(range(8))
    assert close(losses, reference_losses(tmp_path_factory, steps=8, log_every=log_every)), losses
    assert [e["left"] for e in events] == [[0]]


def test_a_membership_change_is_written_once_whoever_becomes_rank_0(tmp_path):
    """Every rank learns of each change; a rank that becomes rank 0 after another one wrote some of them writes
    only the rest (once per epoch), and a resumed log keeps the epochs already on file."""
    from distrain.trainer.metrics import MetricsLog, read_events

    def change(epoch: int) -> dict:
        return {"event": "membership", "epoch": epoch, "step": epoch, "left": [epoch], "joined": []}

    first = MetricsLog(tmp_path / "metrics.jsonl")
    first.write([change(1), {"step": 0, "loss": 1.0}, change(2)])  # rank 0 of epochs 1-2, then lost
    second = MetricsLog(tmp_path / "metrics.jsonl", 2**62)  # the next rank 0 (keeps every line)
    second.rewind(1)
    second.write([change(1), change(2), change(3), {"event": "stop", "step": 3}])  # all it learned of
    second.write([change(3)])
    lines = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r.get("event"), r.get("epoch")) for r in lines] == [
        ("membership", 1), (None, None), ("membership", 2), ("membership", 3), ("stop", None)]
    assert [e["epoch"] for e in read_events(tmp_path / "metrics.jsonl") if e["event"] == "membership"] == [1, 2, 3]
