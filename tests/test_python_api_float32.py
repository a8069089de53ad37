"""A model passed from Python, in float32, the way users train: ``distrain.train(model=...)``.

Every strategy equals one process of the same model and global batch within float32
tolerance over several AdamW steps, at P = 2 and an odd P. fp64 equivalence tests alone
hid a bug here: spawned ranks received the model's tensors in shared memory, so every
rank's optimizer updated one storage (P updates per step) and the caller's model changed;
converting to float64 copied the tensors and hid it. Also: the caller's model and data are
bitwise unchanged, bf16 autocast runs through the same path, and a model whose forward
returns an output object (as Hugging Face models do) trains and evaluates. DiLoCo whose islands are grids
(tp 2, ZeRO-3) equals the one-process simulation of its islands (tests/test_diloco.py) within the same tolerance,
and so does Streaming DiLoCo on grid islands (tp 2, pp 2) against the streaming simulation.

``python tests/test_python_api_float32.py`` prints the table of max differences.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

import distrain
from distrain.models import build_model
from distrain.trainer import TrainConfig
from distrain.trainer.metrics import read_metrics

# P = 2 and an odd P for every strategy a float32 user runs; grids where an odd P cannot exist
# (tp needs P divisible by tp = 2 on gpt-tiny's 4 heads) have their P = 2 and 4 forms
RUNS = {
    "ddp P=2": dict(strategy="ddp", nproc=2), "ddp P=3": dict(strategy="ddp", nproc=3),
    # shared memory, native: the buckets in symmetric memory, reduced in place in every rank's copy
    "ddp shm P=2": dict(strategy="ddp", nproc=2, transport="shm", algorithm="native"),
    "ddp shm P=3": dict(strategy="ddp", nproc=3, transport="shm", algorithm="native"),
    "zero2 shm P=3": dict(strategy="zero2", nproc=3, transport="shm", algorithm="native"),
    "torch-ddp P=2": dict(strategy="torch-ddp", nproc=2), "torch-ddp P=3": dict(strategy="torch-ddp", nproc=3),
    "zero1 P=2": dict(strategy="zero1", nproc=2), "zero1 P=3": dict(strategy="zero1", nproc=3),
    "zero2 P=2": dict(strategy="zero2", nproc=2), "zero2 P=3": dict(strategy="zero2", nproc=3),
    "zero3 P=2": dict(strategy="zero3", nproc=2), "zero3 P=3": dict(strategy="zero3", nproc=3),
    "ps-sync P=2": dict(strategy="ps-sync", nproc=2), "ps-sync P=3": dict(strategy="ps-sync", nproc=3),
    "tp2 P=2": dict(strategy="ddp", nproc=2, tp=2),
    "pp2 P=2": dict(strategy="ddp", nproc=2, pp=2, microbatches=2),
    "pp3 P=3": dict(strategy="ddp", nproc=3, pp=3, microbatches=2),
    "dp2xtp2 P=4": dict(strategy="ddp", nproc=4, dp=2, tp=2),
    "dp1xtp2xpp2 P=4": dict(strategy="ddp", nproc=4, tp=2, pp=2, microbatches=2),
    # context parallelism: each sequence split over 2 ranks (ring attention, or the head all-to-all)
    "cp2 ring P=2": dict(strategy="ddp", nproc=2, cp=2),
    "cp2 all-to-all P=2": dict(strategy="ddp", nproc=2, cp=2, cp_algorithm="all-to-all"),
    # expert parallelism: llama-moe-tiny's 4 experts, 2 per rank, tokens sent to them all-to-all
    "ep2 P=2": dict(strategy="ddp", nproc=2, ep=2),
    # tp x ep: the attention split by tp, the mixture whole on both tp ranks, its experts split by ep
    "tp2xep2 P=4": dict(strategy="ddp", nproc=4, tp=2, ep=2),
}
PRESET = {"ep2 P=2": "llama-moe-tiny", "tp2xep2 P=4": "llama-moe-tiny"}  # the model a run trains (and its one-process reference), else gpt-tiny
# float32 over 4 AdamW steps: reordered sums move the loss by ~1e-6 relative; the shared-weights
# bug moved it by 1e-2 and more from the second step on
RTOL = 2e-5


def _config(out, **kw) -> TrainConfig:
    base = dict(steps=4, batch_size=12, lr=1e-2, dtype="float32", eval_every=0, sample_chars=0, progress=False,
                report=False, log_every=1, out=str(out), timeout=120)
    base.update(kw)
    return TrainConfig(**base)


def _model(preset: str = "gpt-tiny") -> nn.Module:
    torch.manual_seed(0)
    return build_model(preset)  # an nn.Module in the caller, float32, as a user would build it


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


_REF: dict = {}


def _reference(tmp_path_factory, preset: str = "gpt-tiny") -> list[float]:
    if preset not in _REF:
        out = tmp_path_factory.mktemp("single")
        distrain.train(model=_model(preset), config=_config(out, strategy="single", nproc=1))
        _REF[preset] = _losses(out)
    return _REF[preset]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(RUNS))
def test_python_api_float32_equals_one_process(tmp_path, tmp_path_factory, name):
    ref = _reference(tmp_path_factory, PRESET.get(name, "gpt-tiny"))
    model = _model(PRESET.get(name, "gpt-tiny"))
    before = _state(model)
    distrain.train(model=model, config=_config(tmp_path / "run", **RUNS[name]))
    got = _losses(tmp_path / "run")
    assert len(got) == len(ref) == 4
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: losses {got} vs one process {ref}: {m}")
    after = model.state_dict()  # the caller's model is its own: bitwise as it was, and not in shared memory
    assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: train() changed the caller's model"
    assert not any(p.is_shared() for p in model.parameters()), f"{name}: the caller's parameters were moved to shm"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "zero2", "ps-sync"])
def test_elastic_float32_through_the_python_api_survives_a_kill(tmp_path, tmp_path_factory, monkeypatch, strategy):
    """--elastic the way a user runs it: float32, a model object, a rank SIGKILLed at step 2 of 4 (4 -> 3
    ranks, the step redone; zero2 from the lost rank's replica; ps-sync: worker 1 of 3, the server keeps its
    shard). Equal to one process within float32."""
    ref = _reference(tmp_path_factory)
    model = _model()
    before = _state(model)
    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", "1@2")
    summary = distrain.train(model=model, config=_config(tmp_path / "run", strategy=strategy, nproc=4,
                                                         elastic="3:4", collective_timeout=30))
    got = _losses(tmp_path / "run")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0,
                               msg=lambda m: f"elastic {strategy}: losses {got} vs one process {ref}: {m}")
    assert summary["membership_changes"] == 1 and summary["world_final"] == 3
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "train() changed the caller's model"


# DiLoCo whose islands are grids (engines/diloco_grid.py): K = 2 islands of 2 ranks, each tp 2 or ZeRO-3 over its
# 2 ranks, H = 2, 5 steps (outer Nesterov steps after steps 2 and 4; step 5's loss is on what both made)
GRID_ISLANDS = {"diloco K=2 x tp2 P=4": dict(tp=2), "diloco K=2 x zero3 P=4": dict(inner_strategy="zero3")}


@pytest.mark.slow  # each run 3-20 s here (4 ranks on 2 busy cores)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(GRID_ISLANDS))
def test_diloco_grid_islands_float32_equal_the_one_process_simulation(tmp_path, name):
    """Grid islands the way a user runs them (float32, a model object) equal test_diloco's one-process simulation
    of K = 2 islands of the same model (K copies, each its own AdamW on its part of every batch, the outer
    Nesterov step on a master copy) within float32, every step's loss; the caller's model is unchanged."""
    from test_diloco import simulate

    from distrain.trainer.custom import UserParts

    model = _model()
    before = _state(model)
    cfg = _config(tmp_path / "run", strategy="diloco", nproc=4, islands=2, inner_steps=2, steps=5,
                  **GRID_ISLANDS[name])
    summary = distrain.train(model=model, config=cfg)
    got = _losses(tmp_path / "run")
    ref, _, _, _ = simulate(cfg, 2, parts=UserParts(model=model))
    assert len(got) == len(ref) == 5
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: losses {got} vs the simulation {ref}: {m}")
    assert summary["outer_syncs"] == 2
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: train() changed the caller's model"


# Streaming DiLoCo on grid islands (each fragment's outer step over the cross group on the rank's pieces of it):
# K = 2 islands of 2 ranks, 6 steps. tp 2: H = 3, P = 3 fragments at offsets 0, 1, 2, each exchange applied one
# step after it starts (α = 0.5); pp 2: H = 4, P = 4 (each stage lacks a fragment of gpt-tiny's cut, which it
# counts but does not exchange), τ = 1, α = 0.25. Fragment p's exchanges start after steps s with
# (s + 1 − p·H//P) mod H = 0; the one started after step 6 is still pending at the end.
GRID_STREAMING = {"streaming K=2 x tp2 P=3 tau=1": dict(tp=2, inner_steps=3, fragments=3, overlap_steps=1),
                  "streaming K=2 x pp2 P=4 tau=1 a=0.25": dict(pp=2, microbatches=2, inner_steps=4, fragments=4,
                                                               overlap_steps=1, overlap_alpha=0.25)}


@pytest.mark.slow  # each run 3-4 s here (4 ranks on 2 busy cores; the session's first 9-13 s)
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(GRID_STREAMING))
def test_streaming_diloco_grid_islands_float32_equal_the_one_process_simulation(tmp_path, name):
    """Streaming DiLoCo on grid islands the way a user runs it (float32, a model object) equals test_diloco's
    one-process streaming simulation of K = 2 islands of the caller's model within float32, every step's loss;
    each fragment's outer steps and the exchange still in flight are the schedule's; the caller's model is
    unchanged."""
    from test_diloco import shard, simulate

    from distrain.trainer.custom import UserParts

    kw = GRID_STREAMING[name]
    model = _model()
    before = _state(model)
    cfg = _config(tmp_path / "run", strategy="diloco", nproc=4, islands=2, steps=6, **kw)
    summary = distrain.train(model=model, config=cfg)
    got = _losses(tmp_path / "run")
    ref, _, _, left = simulate(cfg, 2, fragments=cfg.fragments, overlap=cfg.overlap_steps, alpha=cfg.overlap_alpha,
                               parts=UserParts(model=model))
    assert len(got) == len(ref) == 6
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: losses {got} vs the simulation {ref}: {m}")
    H, P = cfg.inner_steps, cfg.fragments
    starts = [sum(1 for s in range(6) if (s + 1 - p * H // P) % H == 0) for p in range(P)]
    assert sorted(left) == [p for p in range(P) if (6 - p * H // P) % H == 0]  # the schedule leaves one in flight
    outer = shard(cfg.out, "island1-tp0-pp0")["outer"]
    assert [f["syncs"] for f in outer["fragments"]] == [n - (p in left) for p, n in enumerate(starts)]
    assert sorted(e["fragment"] for e in outer["pending"]) == sorted(left)
    assert summary["outer_syncs"] == sum(starts) - len(left) and summary["fragments"] == P
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), f"{name}: train() changed the caller's model"
    assert not any(p.is_shared() for p in model.parameters()), f"{name}: the caller's parameters were moved to shm"


class Regressor(nn.Module):
    """Returns an output object, as Hugging Face models do (``.logits``)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x):
        return Output(self.net(x))


class Output(dict):
    """A minimal ModelOutput: attribute and key access to ``logits``."""

    def __init__(self, logits):
        super().__init__(logits=logits)
        self.logits = logits


def _classes(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randint(0, 3, (n,), generator=g))


@pytest.mark.timeout(120)
def test_caller_data_unchanged_and_output_objects_train_and_evaluate(tmp_path):
    """A model returning an object with ``.logits`` trains with the default loss and evaluates
    (validation loss and accuracy) at P = 3; the caller's data tensors are bitwise unchanged."""
    torch.manual_seed(0)
    model, train, val = Regressor(), _classes(60, 0), _classes(24, 1)
    data_before = [t.clone() for t in (*train.tensors, *val.tensors)]
    model_before = _state(model)
    runs = {}
    for name, kw in {"single": dict(strategy="single", nproc=1), "ddp3": dict(strategy="ddp", nproc=3)}.items():
        cfg = _config(tmp_path / name, eval_every=2, eval_batches=2, **kw)
        runs[name] = distrain.train(model=model, train_data=train, val_data=val, config=cfg)
    assert all(torch.equal(a, b) for a, b in zip(data_before, (*train.tensors, *val.tensors)))
    assert all(torch.equal(model_before[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(torch.tensor(_losses(tmp_path / "ddp3")), torch.tensor(_losses(tmp_path / "single")),
                               rtol=RTOL, atol=0)
    for s in runs.values():  # 2 batches of 12: accuracy is k/24
        acc = s["final_val_accuracy"]
        assert acc is not None and round(acc * 24) / 24 == acc
    assert abs(runs["ddp3"]["final_val_loss"] - runs["single"]["final_val_loss"]) < 1e-5


@pytest.mark.timeout(120)
def test_bf16_autocast_through_the_python_api(tmp_path):
    """bf16 autocast: the same path; DDP at P=2 equals one process to bf16's precision (the
    matmuls round to 8 bits of mantissa; a P-times learning rate would be far outside it)."""
    losses = {}
    for name, kw in {"single": dict(strategy="single", nproc=1), "ddp": dict(strategy="ddp", nproc=2)}.items():
        model = _model()
        before = _state(model)
        distrain.train(model=model, config=_config(tmp_path / name, autocast="bf16", **kw))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        losses[name] = torch.tensor(_losses(tmp_path / name))
    torch.testing.assert_close(losses["ddp"], losses["single"], rtol=2e-2, atol=0)
    assert losses["ddp"][-1] < losses["ddp"][0]


def _table(names) -> None:  # pragma: no cover - a report for the issue, not a test
    import tempfile
    from pathlib import Path

    root = Path(tempfile.mkdtemp())
    refs = {}
    for preset in {PRESET.get(n, "gpt-tiny") for n in names}:
        distrain.train(model=_model(preset), config=_config(root / f"single-{preset}", strategy="single", nproc=1))
        refs[preset] = torch.tensor(_losses(root / f"single-{preset}"))
    print(f"| run | max rel. loss difference to one process (float32, 4 steps) | caller's model unchanged |")
    print("|---|---|---|")
    for name in names:
        model = _model(PRESET.get(name, "gpt-tiny"))
        ref = refs[PRESET.get(name, "gpt-tiny")]
        before = _state(model)
        distrain.train(model=model, config=_config(root / name.replace(" ", "_"), **RUNS[name]))
        got = torch.tensor(_losses(root / name.replace(" ", "_")))
        same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        print(f"| {name} | {((got - ref).abs() / ref.abs()).max().item():.2e} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    _table(sys.argv[1:] or list(RUNS))


class FailsInEval(nn.Module):
    """Trains; its forward raises in eval mode (an error that only evaluation meets)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(5, 3)

    def forward(self, x):
        if not self.training:
            raise RuntimeError("broken in eval mode")
        return self.net(x)


@pytest.mark.timeout(120)
def test_an_error_in_the_final_evaluation_keeps_the_final_checkpoint(tmp_path):
    from distrain.errors import RankFailedError
    from distrain import checkpoint

    cfg = _config(tmp_path / "run", strategy="ddp", nproc=2, eval_every=4, eval_batches=1)
    with pytest.raises(RankFailedError, match="broken in eval mode"):
        distrain.train(model=FailsInEval(), train_data=_classes(48, 0), val_data=_classes(12, 1), config=cfg)
    manifest = checkpoint.read_manifest(tmp_path / "run")
    assert manifest["step"] == 4  # the run's last step was committed before evaluation started
