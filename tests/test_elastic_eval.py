"""Evaluation in elastic jobs: the same evaluations as the fixed job, through the one training loop.

An elastic job runs the loop every job runs (trainer/loop.py), so it evaluates at the same steps with
the same values as the fixed job of its layout (fp64: equal to rounding), also with pipeline
parallelism (the forward-only schedule) and after a membership change; and an evaluation that raises
leaves the final checkpoint committed, as in a fixed job (the final checkpoint comes first).
"""

from __future__ import annotations

import pytest

from conftest import trainer_config
from test_python_api_float32 import FailsInEval, _classes  # (the model that breaks in evaluation, its data)

RTOL = 1e-10


def _evals(out) -> dict[int, float]:
    from distrain.trainer.metrics import read_metrics

    return {r["step"]: r["val_loss"] for r in read_metrics(out / "metrics.jsonl") if "val_loss" in r}


def _run(out, **kw):
    from distrain.trainer import train

    cfg = trainer_config(out, **{"steps": 4, "eval_every": 2, "eval_batches": 2, "collective_timeout": 30,
                                 "report": False, **kw})
    return train(cfg)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kw", [
    dict(strategy="ddp", nproc=4, pp=2, microbatches=2, elastic="2:4"),
    dict(strategy="ddp", nproc=4, tp=2, elastic="2:4"),
    dict(strategy="zero2", nproc=3, elastic="2:3"),
    dict(strategy="ps-sync", nproc=3, elastic="2:3"),
], ids=["ddp-pp2", "ddp-tp2", "zero2", "ps-sync"])
def test_an_elastic_job_evaluates_where_and_as_the_fixed_job(tmp_path, kw):
    fixed = {k: v for k, v in kw.items() if k != "elastic"}
    _run(tmp_path / "fixed", **fixed)
    summary = _run(tmp_path / "elastic", **kw)
    want, got = _evals(tmp_path / "fixed"), _evals(tmp_path / "elastic")
    assert want, "the fixed job evaluated nowhere"
    assert sorted(got) == sorted(want), (got, want)
    assert all(abs(got[s] - want[s]) <= RTOL * abs(want[s]) for s in want), (got, want)
    assert summary["final_val_loss"] == pytest.approx(want[max(want)], rel=RTOL)


@pytest.mark.timeout(150)
def test_an_elastic_job_evaluates_after_a_membership_change(tmp_path, monkeypatch):
    # id 1 of 4 dies at the start of step 2; the job goes on at 3 ranks and evaluates at steps 2 and 4 (lines
    # 1 and 3) as the fixed 4-rank job does
    _run(tmp_path / "fixed", strategy="ddp", nproc=4)
    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", "1@2")
    summary = _run(tmp_path / "elastic", strategy="ddp", nproc=4, elastic="3:4")
    want, got = _evals(tmp_path / "fixed"), _evals(tmp_path / "elastic")
    assert summary["world_final"] == 3 and sorted(got) == sorted(want) == [1, 3], (got, want)
    assert all(abs(got[s] - want[s]) <= RTOL * abs(want[s]) for s in want), (got, want)


@pytest.mark.timeout(120)
def test_an_error_in_an_elastic_jobs_final_evaluation_keeps_the_final_checkpoint(tmp_path):
    import distrain
    from distrain import checkpoint
    from distrain.errors import RankFailedError
    from distrain.trainer import TrainConfig

    cfg = TrainConfig(strategy="ddp", nproc=2, elastic="2:2", steps=4, batch_size=12, lr=1e-2, eval_every=4,
                      eval_batches=1, sample_chars=0, progress=False, report=False, out=str(tmp_path / "run"),
                      timeout=120, collective_timeout=30)
    with pytest.raises(RankFailedError, match="broken in eval mode"):
        distrain.train(model=FailsInEval(), train_data=_classes(48, 0), val_data=_classes(12, 1), config=cfg)
    assert checkpoint.read_manifest(tmp_path / "run")["step"] == 4  # committed before the evaluation began
