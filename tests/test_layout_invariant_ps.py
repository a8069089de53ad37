"""--layout-invariant with --strategy ps-sync: the parameter servers' steps are one process's, bit for bit.

The workers run their units of work and push int64 sums at shared exponents; the servers add the integers
and convert them back once, clip by the exact norm over their shards, and step their optimizer on their
shard. Every run here is float32 and compared with ``==`` and ``torch.equal`` (no tolerance): every step's
loss as metrics.jsonl has it, and the consolidated final state (parameters and every optimizer state tensor),
against ``--strategy single`` on one process with the same --units.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import consolidated_state, invariant_matrix, state_differences, train_losses, trainer_config

STEPS = 30


def job(out, **kw):
    """A float32 gpt-tiny job with --layout-invariant, 12 units of one sample, clipped at 0.5 (the norm is
    above it for most steps, so the exact-norm clip on the servers acts)."""
    base = dict(dtype="float32", layout_invariant=True, units=12, steps=STEPS, grad_clip=0.5, log_every=10)
    return trainer_config(out, **{**base, **kw})


_REFERENCE: list = []


def reference(tmp_path_factory):
    """The one-process run of ``job()``: (losses, final state), once per session."""
    if not _REFERENCE:
        out = tmp_path_factory.mktemp("ps-invariant-reference")
        _REFERENCE.append((train_losses(job(out, strategy="single", nproc=1)), consolidated_state(out)))
    return _REFERENCE[0]


# -- the traffic of fixed-point pushes (pure) ---------------------------------------------------------------
def test_fixed_point_pushes_are_int64_sums_and_an_exponent_pair_per_parameter():
    from distrain.parallel.parameter_server import PSLayout, expected_ps_bytes

    L = PSLayout(5, 2, [(10,), (10, 10), (30,), (7, 10), 1])  # server 0: 2 params, 110 elements; 1: 3, 101
    assert [L.push_bytes(s, True) for s in (0, 1)] == [8 * (110 + 2 * 2), 8 * (101 + 2 * 3)]
    assert [L.push_bytes(s) for s in (0, 1)] == [440, 404]  # the default push: the shard's bytes
    e = expected_ps_bytes(L, steps=2, final_pull=True, fixed_point=True)
    for w in (0, 1, 2):  # pulls stay float32 weights; pushes are the int64 messages
        assert e[w] == {"ps_pull_sent": 0, "ps_pull_recv": 3 * 844, "ps_push_sent": 2 * (912 + 856),
                        "ps_push_recv": 0, "sent": 2 * (912 + 856), "recv": 3 * 844}
    assert e[3]["ps_push_recv"] == 2 * 3 * 912 and e[4]["ps_push_recv"] == 2 * 3 * 856
    assert e[3]["ps_pull_sent"] == 3 * 3 * 440 and e[4]["ps_pull_sent"] == 3 * 3 * 404
    assert sum(e[r]["sent"] for r in e) == sum(e[r]["recv"] for r in e)
    assert expected_ps_bytes(L, 2, True) == expected_ps_bytes(L, 2, True, fixed_point=False)


def _float_worker_meets_a_fixed_point_server(rank: int):
    from distrain.models import build_model
    from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker

    torch.manual_seed(0)
    model = build_model("mlp-tiny")
    layout = PSLayout.from_model(model, 3, 1)
    if layout.is_server(rank):
        ParameterServer(model, layout, lambda ps: torch.optim.SGD(ps, lr=0.1), "sync", fixed_point_units=4).serve(2)
    else:
        PSWorker(model, layout, "sync").pull()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_float_worker_and_a_fixed_point_server_disagree_at_the_hello():
    import distrain
    from distrain.errors import RankFailedError

    with pytest.raises(RankFailedError) as ei:
        distrain.spawn(_float_worker_meets_a_fixed_point_server, 3, timeout=60)
    assert ei.value.rank in (0, 1)
    assert (f"worker rank {ei.value.rank}: parameter server rank 2 disagrees on the set-up: it serves mode 'sync' "
            f"with fixed-point pushes, 1 servers, 2 workers, shard 0 of 6570 elements; this worker expects mode "
            f"'sync', 1 servers, 2 workers") in str(ei.value)


def test_ps_async_stays_refused_in_one_line(tmp_path):
    from distrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        job(tmp_path / "run", strategy="ps-async", nproc=3).validate()
    assert str(e.value).startswith("--layout-invariant: --strategy ps-async is not covered"), str(e.value)
    assert "\n" not in str(e.value)
    job(tmp_path / "run", strategy="ps-sync", nproc=3).validate()  # (ps-sync is covered)


# -- the matrix: every step's loss and the final state equal one process's ----------------------------------
MATRIX = {
    "ps-sync-3-1server": dict(strategy="ps-sync", nproc=3),                # 2 workers, 6 units each
    "ps-sync-4-1server": dict(strategy="ps-sync", nproc=4),                # 3 workers, 4 units each
    "ps-sync-4-2servers": dict(strategy="ps-sync", nproc=4, servers=2),    # 2 workers, 2 shards
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", invariant_matrix(MATRIX, ["ps-sync-4-2servers"]))
def test_ps_sync_is_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    want_losses, want_state = reference(tmp_path_factory)
    out = tmp_path / "run"
    losses = train_losses(job(out, **MATRIX[name]))
    assert len(losses) == len(want_losses) == STEPS
    wrong = [(i, a, b) for i, (a, b) in enumerate(zip(losses, want_losses)) if a != b]
    assert not wrong, f"{len(wrong)} step losses differ, first {wrong[:3]}"
    assert state_differences(consolidated_state(out), want_state) == []
    # the servers received exactly the fixed-point pushes' bytes (PSLayout.push_bytes)
    assert json.loads((out / "summary.json").read_text())["ps_bytes_match"] is True


# -- elastic ps-sync: workers lost and gained mid-run, the same bits ------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("faults, kw, change", [
    ("1@2", dict(nproc=4, elastic="3:4"), (4, 3, [1], [], 2)),                        # 3 workers -> 2
    ("0@2:hold", dict(nproc=3, elastic="3:4", elastic_replace=1), (3, 4, [], [3], 1)),  # 2 workers -> 3
], ids=["lose-a-worker", "a-newcomer-works"])
def test_elastic_ps_sync_is_one_process_bit_for_bit(tmp_path, monkeypatch, faults, kw, change):
    """The units move between workers at a membership change (the redone step too); the servers' sums do not
    see it. 8 steps, so the change falls mid-run."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_events, read_metrics

    ref = tmp_path / "single"
    want = train_losses(job(ref, strategy="single", nproc=1, steps=8, log_every=2))
    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", faults)
    out = tmp_path / "run"
    train(job(out, strategy="ps-sync", steps=8, log_every=2, collective_timeout=30, **kw))
    rows = read_metrics(out / "metrics.jsonl")
    events = [e for e in read_events(out / "metrics.jsonl") if e["event"] == "membership"]
    assert [(e["old_world"], e["new_world"], e["left"], e["joined"], e["step"]) for e in events] == [change]
    assert [r["loss"] for r in rows] == want
    assert state_differences(consolidated_state(out), consolidated_state(ref)) == []
