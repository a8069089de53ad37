"""The fast tier's equivalence checks: one quick check of each family, against its ground truth.

Each family has deeper tests in the slow tier (more algorithms, world sizes and layouts); these are the
ones that run on every ``pytest -m "not slow"``: a collective against the sum computed here and against
the native backend; DDP, ZeRO-1, ZeRO-3, tensor parallelism and pipeline parallelism through the trainer
against the single-process run of the same model and global batch (fp64, 5 AdamW steps, rtol 1e-10); an
exact resume; and the float32 Python API (``distrain.train(model=...)``) against one process.
"""

from __future__ import annotations

import pytest
import torch

from conftest import reference_losses, run_ranks, train_losses, trainer_config

RTOL = 1e-10


def close(a: list[float], b: list[float], rtol: float = RTOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def _collectives(rank: int) -> list[str]:
    from distrain import comm

    bad = []
    world = comm.get_world_size()
    for algorithm in ("ring", "tree", "star"):
        t = torch.arange(10, dtype=torch.float64) * (rank + 1)  # 10 is not divisible by 3
        comm.all_reduce(t, algorithm=algorithm)
        want = torch.arange(10, dtype=torch.float64) * sum(range(1, world + 1))
        native = torch.arange(10, dtype=torch.float64) * (rank + 1)
        comm.all_reduce(native, algorithm="native")
        if not (torch.equal(t, want) and torch.equal(native, want)):
            bad.append(f"all_reduce {algorithm}: {t.tolist()} vs {want.tolist()} (native {native.tolist()})")
    return bad


@pytest.mark.timeout(60)
def test_all_reduce_equals_the_sum_and_the_native_backend_at_p3():
    run_ranks(_collectives, 3)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kw", [
    dict(strategy="ddp", nproc=2), dict(strategy="zero1", nproc=2), dict(strategy="zero3", nproc=3, batch_size=12),
    dict(strategy="ddp", nproc=2, tp=2), dict(strategy="ddp", nproc=2, pp=2, microbatches=2),
], ids=["ddp", "zero1", "zero3-p3", "tp2", "pp2"])
def test_the_trainer_equals_one_process(tmp_path, tmp_path_factory, kw):
    got = train_losses(trainer_config(tmp_path / "run", **kw))
    assert close(got, reference_losses(tmp_path_factory)), (got, reference_losses(tmp_path_factory))


@pytest.mark.timeout(60)
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    train_losses(trainer_config(out, strategy="ddp", nproc=2, steps=3, ckpt_every=3))
    got = train_losses(trainer_config(out, strategy="ddp", nproc=2, steps=5, resume=True))
    assert close(got, reference_losses(tmp_path_factory)), (got, reference_losses(tmp_path_factory))


@pytest.mark.timeout(60)
def test_the_float32_python_api_equals_one_process(tmp_path):
    import distrain
    from distrain.models import build_model
    from distrain.trainer import TrainConfig
    from distrain.trainer.metrics import read_metrics

    def losses(out, **kw):
        torch.manual_seed(0)
        model = build_model("gpt-tiny")  # float32, as a user builds it
        cfg = TrainConfig(steps=4, batch_size=12, lr=1e-2, dtype="float32", eval_every=0, sample_chars=0,
                          progress=False, report=False, log_every=1, out=str(out), timeout=120, **kw)
        distrain.train(model=model, config=cfg)
        return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]

    ref = losses(tmp_path / "one", strategy="single", nproc=1)
    got = losses(tmp_path / "ddp", strategy="ddp", nproc=2)
    assert close(got, ref, rtol=2e-5), (got, ref)
