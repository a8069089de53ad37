"""One loop, many engines: the same job gives the same checkpoint layout, checkpoint sets are
atomic, and a resume that cannot work is refused before any rank starts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from distrain.errors import ConfigError
from distrain.checkpoint import store as checkpoint
from distrain.trainer import train
from distrain.trainer.config import STRATEGIES
from distrain.trainer.engines import ENGINES, Engine, engine_class

from conftest import run_ranks, train_losses, trainer_config


def _files(out) -> list[str]:
    return sorted(p for p in os.listdir(out) if p.startswith("checkpoint"))


def test_every_strategy_has_an_engine():
    assert set(ENGINES) == set(STRATEGIES)
    for name in STRATEGIES:
        cls = engine_class(trainer_config("x", strategy=name))
        assert issubclass(cls, Engine) and cls.__module__.startswith("distrain.trainer.engines.")
    for kw in [dict(nproc=4, tp=2, pp=2), dict(strategy="ddp", nproc=2), dict(strategy="zero3", nproc=3),
               dict(strategy="zero1", nproc=4, tp=2), dict(nproc=2, cp=2)]:  # one engine for every layout
        assert engine_class(trainer_config("x", **kw)).__name__ == "GridEngine", kw


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_same_job_same_checkpoint_whichever_flags_spell_it(tmp_path):
    kw = dict(model="mlp-tiny", data="digits", steps=3, batch_size=8)
    by_strategy = trainer_config(tmp_path / "a", strategy="ddp", nproc=2, **kw)
    by_grid = trainer_config(tmp_path / "b", nproc=2, dp=2, tp=1, pp=1, **kw)
    assert train_losses(by_strategy) == train_losses(by_grid)
    assert _files(by_strategy.out) == _files(by_grid.out) == ["checkpoint-00000003-tp0-pp0.pt", "checkpoint.json"]
    manifests = [json.loads((tmp_path / d / "checkpoint.json").read_text()) for d in "ab"]
    for m in manifests:
        assert (m["step"], m["layout"], m["files"]) == (3, {"dp": 2, "tp": 1, "pp": 1},
                                                        ["checkpoint-00000003-tp0-pp0.pt"])
    a, b = (checkpoint.load(tmp_path / d / "checkpoint-00000003-tp0-pp0.pt") for d in "ab")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def _interrupted_set(rank: int, out: str) -> list[str]:
    import torch.distributed as dist

    def state(step):
        return {"w": torch.full((4,), float(step + rank))}

    checkpoint.save_set(out, 1, {"dp": 1}, f"s{rank}", state(1), meta={"model": "m"})
    # step 2: both shards are written, then rank 0 dies before the manifest is committed
    real = checkpoint._atomic_write
    if rank == 0:
        def no_manifest(path, write, *rest):
            if path.name == checkpoint.MANIFEST:
                raise OSError("killed before the commit")
            return real(path, write, *rest)
        checkpoint._atomic_write = no_manifest
    try:
        checkpoint.save_set(out, 2, {"dp": 1}, f"s{rank}", state(2))
    except OSError:
        dist.barrier()  # stand in for the barrier the dead rank 0 never reached
    checkpoint._atomic_write = real
    dist.barrier()
    problems = []
    m = checkpoint.read_manifest(out)  # still the step-1 set, complete and loadable
    if m["step"] != 1 or m["files"] != ["checkpoint-00000001-s0.pt", "checkpoint-00000001-s1.pt"]:
        problems.append(f"manifest after the interrupted commit: {m}")
    if not torch.equal(checkpoint.load_shard(out, m, f"s{rank}")["w"], state(1)["w"]):
        problems.append("the step-1 shard changed")
    dist.barrier()
    checkpoint.save_set(out, 3, {"dp": 1}, f"s{rank}", state(3))  # a good commit clears every older file
    if rank == 0 and _files(out) != ["checkpoint-00000003-s0.pt", "checkpoint-00000003-s1.pt", "checkpoint.json"]:
        problems.append(f"files after the next commit: {_files(out)}")
    return problems


@pytest.mark.timeout(60)
def test_checkpoint_set_is_atomic(tmp_path):
    run_ranks(_interrupted_set, 2, str(tmp_path), timeout=45)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.timeout(90)
def test_resume_that_cannot_work_is_refused_before_any_rank_starts(tmp_path, monkeypatch):
    kw = dict(model="mlp-tiny", data="digits", steps=2, batch_size=8)
    train(trainer_config(tmp_path / "run", strategy="single", nproc=1, **kw))

    import distrain.trainer.loop as loop

    def no_spawn(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(loop, "spawn", no_spawn)
    with pytest.raises(ConfigError, match=r"holds model 'mlp-tiny', this run trains --model gpt-tiny; resume with"):
        train(trainer_config(tmp_path / "run", strategy="single", nproc=1, resume=True, steps=4))
    with pytest.raises(ConfigError, match=r"layout \{'dp': 1, 'tp': 1, 'pp': 1\}, this run uses \{'dp': 2, 'tp': 1, "
                                          r"'pp': 1\}; resume with the same --dp/--tp/--pp"):
        train(trainer_config(tmp_path / "run", strategy="ddp", nproc=2, resume=True, **{**kw, "steps": 4}))
    with pytest.raises(ConfigError, match=r"at step 2, past --steps 1"):
        train(trainer_config(tmp_path / "run", strategy="single", nproc=1, resume=True, **{**kw, "steps": 1}))
    (tmp_path / "run" / "checkpoint-00000002-tp0-pp0.pt").unlink()
    with pytest.raises(ConfigError, match=r"names checkpoint-00000002-tp0-pp0\.pt, which do not exist"):
        train(trainer_config(tmp_path / "run", strategy="single", nproc=1, resume=True, **{**kw, "steps": 4}))


@pytest.mark.timeout(120)
def test_local_trains_unsynchronized_replicas_and_refuses_to_resume(tmp_path):
    """``local`` (bench train's floor) exchanges nothing: the replicas' weights differ after
    training on different slices; there is no one state to resume."""
    with pytest.raises(ConfigError, match=r"--strategy local trains P unsynchronized replicas .*drop "
                                          r"--resume/--ckpt-every, or use --strategy ddp"):
        trainer_config(tmp_path / "x", strategy="local", resume=True).validate()
    summary = train(trainer_config(tmp_path / "run", strategy="local", nproc=2, steps=2))
    assert [t["sent"] for t in summary["bytes_per_step"]] == [0, 0]
    import distrain

    w = distrain.spawn(_local_weights, 2, args=(str(tmp_path / "w"),), timeout=90)
    assert not torch.equal(w[0], w[1])


def _local_weights(rank, out):
    from distrain.trainer.engines.baselines import LocalEngine

    torch.manual_seed(0)  # the same initial weights on both ranks
    model = torch.nn.Linear(4, 1, dtype=torch.float64)
    cfg = trainer_config(out, strategy="local", nproc=2, model="mlp-tiny", data="digits")
    eng = LocalEngine(cfg, model, torch.nn.functional.mse_loss, lambda p: torch.optim.SGD(p, lr=0.1))
    x = torch.full((2, 4), float(rank + 1), dtype=torch.float64)  # each rank its own slice
    eng.train_step(x, torch.zeros(2, 1, dtype=torch.float64))
    return model.weight.detach().clone()
