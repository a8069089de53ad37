"""--strategy diloco with --elastic: a lost island dropped, a newcomer fed the outer state; islands of several ranks.

Against a single-process simulation in plain torch, fp64 at rel 1e-10 (``simulate_elastic``: islands as model
copies keyed by rank id, each with its own AdamW, every H steps the survivors' mean of θ_prev − θ_i driving
torch.optim.SGD(nesterov=True) on the master copy):

* a rank SIGKILLed at the start of step k (between outer steps, and at a step that takes the outer step, whose
  survivors had already taken their inner update and entered the outer all-reduce): every survivor goes back to
  its own state at step k's start, the lost island's inner progress since the last outer step is dropped, step
  k is redone by K − 1 islands on the global batch cut in K − 1 parts, and the outer steps from then on average
  over the survivors: every step's loss, each surviving island's final parameters and θ_prev;
* a rank SIGSTOPped at an outer step (alive to its connections): the survivors go on at the heartbeat's
  detection, well within --collective-timeout, with the same result;
* then a replacement joining at a step boundary j: it takes the outer state from a live peer, starts from
  θ_prev with a fresh AdamW and reads part K' − 1 of each batch from step j on; the next outer step averages
  over all K' islands.

With --islands 2 of 2 ranks (ids 0, 1 | 2, 3; each rank stays in its island: live_islands):

* one rank of island 1 SIGKILLed between outer steps and at an outer step: island 1 goes on with its survivor
  on its whole part of each batch, so the losses, both islands and θ_prev are the fault-free K = 2 simulation's;
* one rank of island 1 SIGSTOPped at an outer step: the same, the survivors going on at the heartbeat's detection;
* island 1's two ranks killed one after the other: the simulation with island 1 dropped at the second's step;
* a replacement after one rank of island 1 was lost: it joins island 1 (the smallest) and takes its inner
  state, so the losses stay the fault-free simulation's; after both were lost: it founds an island from θ_prev
  (the simulation with island 1 dropped and a new island from the join).

The refusal of what stays unsupported (Streaming DiLoCo; with --islands the quantized outer means) and the
island map (island_labels, live_islands) are in the fast tier; the multi-process runs are slow.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import assert_refused, trainer_config
from test_diloco import RTOL, close, shard, simulation_parts


def simulate_elastic(cfg, ids: list[int], changes: dict[int, tuple[list[int], list[int]]]):
    """Elastic DiLoCo in one process: (the step losses, {id: island's final state_dict}, the outer parameters
    by name). ``ids``: the starting ranks' ids (rank order); ``changes``: {step: (ids lost, ids joined)}, the
    membership from that step on (the survivors in their order, the newcomers after them: the coordinator's
    order). The island at rank r of K reads part r of K of every global batch; a lost island is dropped with
    whatever it did since the last outer step; a newcomer is a copy holding θ_prev, with a fresh optimizer."""
    from distrain.trainer.task import build_optimizer

    start, task, loss_fn, sampler = simulation_parts(cfg)
    islands = {i: copy.deepcopy(start) for i in ids}
    inner = {i: build_optimizer(cfg, m.parameters()) for i, m in islands.items()}
    names = [n for n, _ in start.named_parameters()]
    master = [p.detach().clone() for p in start.parameters()]
    outer = torch.optim.SGD(master, lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                            nesterov=cfg.outer_optimizer == "nesterov")
    order, losses = list(ids), []
    for step in range(cfg.steps):
        lost, joined = changes.get(step, ([], []))
        for i in lost:
            order.remove(i)
            del islands[i], inner[i]
        for i in joined:
            m = copy.deepcopy(start)
            with torch.no_grad():
                for p, w in zip(m.parameters(), master):
                    p.copy_(w)
            islands[i], inner[i] = m, build_optimizer(cfg, m.parameters())
            order.append(i)
        K, step_loss = len(order), 0.0
        for r, i in enumerate(order):
            x, y = task.batch(task.train, sampler.part(step, r, K))
            inner[i].zero_grad()
            loss = loss_fn(islands[i](x), y)
            loss.backward()
            inner[i].step()
            step_loss += loss.item() / K
        losses.append(step_loss)
        if (step + 1) % cfg.inner_steps == 0:
            with torch.no_grad():
                held = [list(islands[i].parameters()) for i in order]
                for j, w in enumerate(master):
                    w.grad = torch.stack([w - ps[j] for ps in held]).mean(dim=0)
                outer.step()
                for ps in held:
                    for p, w in zip(ps, master):
                        p.copy_(w)
    return losses, {i: m.state_dict() for i, m in islands.items()}, dict(zip(names, master))


def run(tmp_path, monkeypatch, faults: str, **kw):
    """An elastic DiLoCo job (gpt-tiny, fp64, H = 2); returns (its config, step losses, membership lines, summary
    or the error)."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_events, read_metrics

    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", faults)
    cfg = trainer_config(tmp_path / "run", **{"strategy": "diloco", "inner_steps": 2, "collective_timeout": 30,
                                              "report": False, **kw})
    try:
        result = train(cfg)
    except Exception as e:  # noqa: BLE001 - the test looks at it
        result = e
    path = tmp_path / "run" / "metrics.jsonl"
    return cfg, [r["loss"] for r in read_metrics(path)], read_events(path), result


def assert_params_close(got: dict, want: dict) -> None:
    """Every tensor equal to rel 1e-10 of its values, or of the model's largest parameter where a value is at the
    rounding's scale (a key projection's bias gets no gradient but rounding noise, ~1e-14; the 3-rank ring sums
    the islands' Δ in another order than the simulation's mean)."""
    assert got.keys() == want.keys()
    scale = max(float(w.abs().max()) for w in want.values() if w.is_floating_point())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=RTOL * scale, msg=lambda m: f"{k}: {m}")


def check_islands(cfg, order: list[int], states: dict, master: dict, syncs: int) -> None:
    """Every final island (shard island{r}: the rank r of the final group, id order[r]) equals the simulation's,
    and so does θ_prev; the islands differ (the last step is past the last outer step: a real check)."""
    for r, i in enumerate(order):
        saved = shard(cfg.out, f"island{r}")
        assert_params_close(saved["model"], states[i])
        assert saved["outer"]["syncs"] == syncs
        assert_params_close(dict(zip(master, saved["outer"]["master"])), master)
    w = next(iter(states[order[0]]))
    assert not torch.equal(states[order[0]][w], states[order[1]][w])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kill", [2, 3], ids=["between-outer-steps", "at-an-outer-step"])
def test_a_lost_island_is_dropped_and_the_outer_step_averages_the_survivors(tmp_path, monkeypatch, kill):
    # id 1 SIGKILLs itself at the start of step ``kill``; at step 3 (an outer step: (3 + 1) % 2 == 0) ids 0 and 2
    # have taken their inner update and wait in the outer all-reduce when the loss breaks it
    cfg, losses, events, summary = run(tmp_path, monkeypatch, f"1@{kill}", nproc=3, elastic="2:3", steps=7)
    assert isinstance(summary, dict), summary
    (e,) = events
    assert (e["event"], e["old_world"], e["new_world"], e["left"], e["joined"], e["step"], e["rolled_back"]) == \
           ("membership", 3, 2, [1], [], kill, kill)
    assert 0 < e["recover_s"] < 30  # (nobody waited on the dead island past its detection)
    want, states, master = simulate_elastic(cfg, [0, 1, 2], {kill: ([1], [])})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 2], states, master, syncs=3)
    assert summary["outer_syncs"] == 3 and summary["islands"] == 2


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_frozen_island_breaks_the_outer_all_reduce_well_before_the_time_out(tmp_path, monkeypatch):
    # id 1 SIGSTOPs itself at step 3 (its connections stay open: it looks alive to the outer all-reduce that ids 0
    # and 2 wait in); the coordinator sees its heartbeat stop and ends the epoch, the survivors' watchdogs break
    # the group: they go on at the detection time, not at --collective-timeout 60
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "1@3:stop", nproc=3, elastic="2:3", steps=7,
                                       collective_timeout=60)
    assert isinstance(summary, dict), summary
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"]) == (3, 2, [1], 3, 3)
    assert e["recover_s"] < 30, e
    want, states, master = simulate_elastic(cfg, [0, 1, 2], {3: ([1], [])})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 2], states, master, syncs=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replacement_takes_the_outer_state_and_joins_the_next_outer_step(tmp_path, monkeypatch):
    # id 1 SIGKILLs itself at step 3 (3 -> 2, step 3 redone); its replacement (id 3) joins while id 0 holds step 5
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "1@3,0@5:hold", nproc=3, elastic="2:3",
                                       elastic_replace=1, steps=9)
    assert isinstance(summary, dict), summary
    lost, join = events
    assert (lost["left"], lost["joined"], lost["step"], lost["new_world"]) == ([1], [], 3, 2)
    assert (join["left"], join["joined"], join["new_world"], join["rolled_back"]) == ([], [3], 3, None)
    assert 4 <= join["step"] <= 6
    want, states, master = simulate_elastic(cfg, [0, 1, 2], {3: ([1], []), join["step"]: ([], [3])})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 2, 3], states, master, syncs=4)
    assert summary["outer_syncs"] == 4 and summary["world_final"] == 3


def check_one_island(cfg, states: dict, master: dict, syncs: int) -> None:
    """The last island (shard island0) equals the simulation's, and so does θ_prev; the island differs from θ_prev
    (the last step is past the last outer step: a real check)."""
    (i, want), = states.items()
    saved = shard(cfg.out, "island0")
    assert_params_close(saved["model"], want)
    assert saved["outer"]["syncs"] == syncs
    assert_params_close(dict(zip(master, saved["outer"]["master"])), master)
    w = next(iter(master))
    assert not torch.equal(want[w], master[w])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill", [2, 3], ids=["between-outer-steps", "at-an-outer-step"])
def test_a_rank_lost_from_an_island_of_two_loses_nothing(tmp_path, monkeypatch, kill):
    # K = 2 islands of 2 ranks (ids 0, 1 | 2, 3); id 3 SIGKILLs itself at the start of step ``kill`` (3: an outer
    # step, which island 0 reaches while island 1's DDP all-reduce breaks). Island 1 goes on with id 2 alone,
    # reading the island's whole part of each batch: the losses, both islands and θ_prev are the fault-free
    # K = 2 simulation's
    cfg, losses, events, summary = run(tmp_path, monkeypatch, f"3@{kill}", nproc=4, islands=2, elastic="2:4",
                                       steps=7)
    assert isinstance(summary, dict), summary
    (e,) = events
    assert (e["event"], e["old_world"], e["new_world"], e["left"], e["joined"], e["step"], e["rolled_back"]) == \
           ("membership", 4, 3, [3], [], kill, kill)
    assert 0 < e["recover_s"] < 30
    want, states, master = simulate_elastic(cfg, [0, 1], {})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 1], states, master, syncs=3)
    assert (summary["outer_syncs"], summary["islands"], summary["ranks_per_island"]) == (3, 2, [2, 1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_frozen_rank_of_an_island_holds_nobody_past_the_detection(tmp_path, monkeypatch):
    # id 3 SIGSTOPs itself at step 3 (an outer step): id 2 waits on it in island 1's DDP all-reduce, ids 0 and 1 in
    # the outer all-reduce; the heartbeat's detection breaks both groups long before --collective-timeout 60, and
    # island 1 goes on with id 2: the fault-free K = 2 simulation
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "3@3:stop", nproc=4, islands=2, elastic="2:4",
                                       steps=7, collective_timeout=60)
    assert isinstance(summary, dict), summary
    (e,) = events
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"]) == (4, 3, [3], 3, 3)
    assert e["recover_s"] < 30, e
    want, states, master = simulate_elastic(cfg, [0, 1], {})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 1], states, master, syncs=3)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_island_whose_last_rank_is_lost_is_dropped_at_that_step(tmp_path, monkeypatch):
    # id 2 SIGKILLs itself at step 2 (island 1 goes on with id 3), then id 3 at step 5 (an outer step): island 1
    # is gone from step 5 on, its inner progress since the outer step after step 3 dropped; island 0 (2 ranks)
    # redoes step 5 alone on the whole batch: the simulation with island 1 dropped at step 5
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "2@2,3@5", nproc=4, islands=2, elastic="1:4",
                                       steps=7)
    assert isinstance(summary, dict), summary
    first, second = events
    assert (first["old_world"], first["new_world"], first["left"], first["step"]) == (4, 3, [2], 2)
    assert (second["old_world"], second["new_world"], second["left"], second["step"], second["rolled_back"]) == \
           (3, 2, [3], 5, 5)
    want, states, master = simulate_elastic(cfg, [0, 1], {5: ([1], [])})
    assert close(losses, want), (losses, want)
    check_one_island(cfg, states, master, syncs=3)
    assert (summary["outer_syncs"], summary["islands"], summary["ranks_per_island"]) == (3, 1, 2)


def changes_of(events: list[dict]) -> dict[int, tuple[list[int], list[int]]]:
    """The membership lines as {step: (ids left, ids joined)}, two changes at one step merged."""
    out: dict[int, tuple[list[int], list[int]]] = {}
    for e in events:
        left, joined = out.setdefault(e["step"], ([], []))
        left += e["left"]
        joined += e["joined"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replacement_joins_the_island_that_lost_a_rank_and_takes_its_inner_state(tmp_path, monkeypatch):
    # id 3 SIGKILLs itself at step 3 (island 1 goes on with id 2); its replacement (id 4) joins while id 0 holds
    # step 5: island 1 has the fewest ranks, so id 4 joins it and takes island 1's replica and inner optimizer
    # state from id 2 (a newcomer holding θ_prev instead would average other gradients in island 1's DDP): the
    # fault-free K = 2 simulation, and 2 islands of 2 ranks at the end
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "3@3,0@5:hold", nproc=4, islands=2, elastic="2:4",
                                       elastic_replace=1, steps=9)
    assert isinstance(summary, dict), summary
    assert changes_of(events) == {3: ([3], [])} | {events[-1]["step"]: ([], [4])} or \
        changes_of(events) == {3: ([3], [4])}  # (a replacement ready before the loss's change is in it)
    assert events[-1]["new_world"] == 4 and 3 <= events[-1]["step"] <= 6
    want, states, master = simulate_elastic(cfg, [0, 1], {})
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 1], states, master, syncs=4)
    assert (summary["islands"], summary["ranks_per_island"], summary["world_final"]) == (2, 2, 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_replacement_founds_an_island_when_one_was_lost(tmp_path, monkeypatch):
    # ids 2 and 3 (island 1) SIGKILL themselves at step 3: island 1 is dropped there (K = 1); the replacement (id 4)
    # joins while id 0 holds step 5 and, fewer than K = 2 islands being live, founds a new island from θ_prev
    # with a fresh inner optimizer: the simulation with island 1 dropped at step 3 and a new one from the join
    cfg, losses, events, summary = run(tmp_path, monkeypatch, "2@3,3@3,0@5:hold", nproc=4, islands=2,
                                       elastic="1:4", elastic_replace=1, steps=9)
    assert isinstance(summary, dict), summary
    changes = changes_of(events)  # {step: (ids lost, ids joined)}: the losses at step 3 (in one change or two)
    j = events[-1]["step"]
    assert sorted(i for lost, _ in changes.values() for i in lost) == [2, 3] and set(changes) == {3, j}
    assert changes[j][1] == [4] and events[-1]["new_world"] == 3 and 3 <= j <= 6
    want, states, master = simulate_elastic(cfg, [0, 1], {3: ([1], [4] if j == 3 else [])} |
                                            ({j: ([], [4])} if j != 3 else {}))
    assert close(losses, want), (losses, want)
    check_islands(cfg, [0, 4], states, master, syncs=4)
    assert (summary["islands"], summary["ranks_per_island"], summary["world_final"]) == (2, [2, 1], 3)


def test_ranks_keep_their_island_and_newcomers_found_or_join_the_smallest():
    from distrain.parallel.diloco import island_labels, live_islands

    start = [0, 1, 2, 3]
    assert live_islands(2, [start]) == [[0, 1], [2, 3]]
    assert live_islands(2, [start, [0, 1, 2]]) == [[0, 1], [2]]  # (id 3 lost: island 1 keeps id 2)
    assert live_islands(2, [start, [0, 2, 3]]) == [[0], [1, 2]]
    assert live_islands(3, [[0, 1, 2, 3, 4, 5], [1, 4, 5]]) == [[0], [1, 2]]  # (island 1 gone: K = 2)
    # a newcomer (id 4) joins the live island with the fewest ranks: island 1, which lost id 3
    assert island_labels(2, [start, [0, 1, 2], [0, 1, 2, 4]]) == {0: 0, 1: 0, 2: 1, 3: 1, 4: 1}
    assert live_islands(2, [start, [0, 1, 2], [0, 1, 2, 4]]) == [[0, 1], [2, 3]]
    # equal islands: the first in island order (island 1's first rank comes first once id 0 is lost)
    assert island_labels(2, [start, [1, 2, 3], [1, 2, 3, 4]])[4] == 0 and \
        island_labels(2, [start, [0, 2], [0, 2, 4]])[4] == 0
    # island 1 gone (K = 1 < 2): a newcomer founds a new island (label 2), after the survivors
    assert island_labels(2, [start, [0, 1], [0, 1, 4]])[4] == 2
    assert live_islands(2, [start, [0, 1], [0, 1, 4, 5]]) == [[0, 1], [2, 3]]  # (id 5 joins it then: the smallest)
    assert island_labels(2, [start, [0, 1], [0, 1, 4], [0, 4, 5]])[5] == 0  # (4 keeps its island; 5: the first)


@pytest.mark.parametrize("kw,message", [
    (dict(nproc=4, islands=2, elastic="2:4", elastic_replace=1), None),  # (newcomers: founders or joiners)
    (dict(nproc=4, islands=2, elastic="2:4", outer_compression="int8"),
     "--elastic 2:4: --outer-compression int8 with --islands 2 is not supported (the outer mean of islands of "
     "different sizes is a sum over every rank, which a quantized reduce-scatter of one chunk per island cannot "
     "make); use --outer-compression bf16 or leave it out"),
    (dict(nproc=6, islands=4, elastic="2:6"),
     "--islands 4 does not divide --nproc 6 into equal islands; use a divisor of 6"),
    (dict(nproc=4, islands=2, elastic="1:4"), None),  # (MIN below K: the job may go on down to one island)
    (dict(nproc=2, elastic="1:2", overlap_steps=1),
     "--elastic 1:2: Streaming DiLoCo (--fragments 1, --overlap-steps 1) is not supported (an exchange in flight "
     "across steps would carry a lost island's outer gradient); use --fragments 1 --overlap-steps 0"),
    (dict(nproc=2, elastic="1:2", fragments=2),
     "--elastic 1:2: Streaming DiLoCo (--fragments 2, --overlap-steps 0) is not supported (an exchange in flight "
     "across steps would carry a lost island's outer gradient); use --fragments 1 --overlap-steps 0"),
])
def test_refusals(tmp_path, kw, message):
    # --islands K: no quantized outer mean; --nproc splits into K; MIN below K and newcomers are fine
    assert_refused(trainer_config(tmp_path, strategy="diloco", **kw), message)
