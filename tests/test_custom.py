"""Your own model and data: distrain.train(model=..., train_data=..., loss_fn=...) and the CLI's
--model/--data/--loss PKG.MOD:NAME, on any strategy that applies; equal to one process."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distrain
from distrain.cli import main
from distrain.errors import ConfigError
from distrain.trainer import TrainConfig
from distrain.trainer.metrics import read_metrics


class TwoLayer(nn.Module):
    """Not one of distrain's models: a small classifier whose layers run in order (pipelines split it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))


def _config(out, **kw) -> TrainConfig:
    base = dict(steps=5, batch_size=12, lr=0.05, dtype="float64", eval_every=5, eval_batches=2, progress=False,
                report=False, log_every=1, out=str(out), timeout=120)
    base.update(kw)
    return TrainConfig(**base)


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.timeout(420)
def test_python_api_trains_your_model_on_every_strategy(tmp_path):
    train, val = _data(96, 0), _data(24, 1)
    runs = {"single": dict(strategy="single", nproc=1), "ddp3": dict(strategy="ddp", nproc=3),
            "ps": dict(strategy="ps-sync", nproc=3), "pp2": dict(strategy="ddp", nproc=2, pp=2, microbatches=2)}
    summaries = {name: distrain.train(model=TwoLayer(), train_data=train, val_data=val, loss_fn=F.cross_entropy,
                                      config=_config(tmp_path / name, **kw)) for name, kw in runs.items()}
    ref = _losses(tmp_path / "single")
    for name in runs:
        torch.testing.assert_close(torch.tensor(_losses(tmp_path / name)), torch.tensor(ref), rtol=1e-10, atol=0,
                                   msg=lambda m: f"{name}: {m}")
    # a classifier: accuracy over the 2 validation batches of 12 (k/24)
    acc = summaries["single"]["final_val_accuracy"]
    assert acc is not None and round(acc * 24) / 24 == acc
    assert json.loads((tmp_path / "single" / "config.json").read_text())["model"] == "custom"


MODULE = '''
import torch, torch.nn as nn
from torch.utils.data import TensorDataset

def make_net():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return TensorDataset(x, x.sum(dim=1, keepdim=True)), TensorDataset(x[:16], x[:16].sum(dim=1, keepdim=True))
'''


@pytest.mark.timeout(200)
def test_cli_model_and_data_factories(tmp_path, monkeypatch):
    (tmp_path / "mynets.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{':'.join(sys.path)}")
    out = tmp_path / "run"
    assert main(["train", "--model", "mynets:make_net", "--data", "mynets:make_data", "--loss", "mse",
                 "--strategy", "ddp", "--nproc", "2", "--steps", "40", "--batch-size", "16", "--lr", "0.05",
                 "--eval-every", "20", "--eval-batches", "1", "--no-progress", "--no-report", "--out", str(out)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    # a regression that learns (the factory's model is seeded from --seed: the same numbers every run;
    # at this seed the loss goes 2.28 -> 0.045 and the validation loss 0.42 -> 0.055)
    assert len(rows) == 40 and rows[-1]["loss"] < rows[0]["loss"] / 10
    assert rows[-1]["val_loss"] < rows[19]["val_loss"] / 2
    assert "val_accuracy" not in rows[-1] and "val_loss" in rows[-1]  # no accuracy for a regression


@pytest.mark.parametrize("kw,match", [
    (dict(model="nosuchpkg.nets:make"), r"--model nosuchpkg\.nets:make: cannot import nosuchpkg"),
    (dict(model="torch.nn:NoSuchFactory"), r"--model torch\.nn:NoSuchFactory: torch\.nn has no 'NoSuchFactory'"),
    (dict(model="builtins:dict"), r"--model builtins:dict returned a dict, not an nn\.Module"),
    (dict(loss="hinge"), r"--loss 'hinge' is unknown; use auto, cross-entropy, mse or PKG\.MOD:FN"),
])
def test_bad_factories_are_one_line_errors(tmp_path, kw, match):
    from distrain.trainer.custom import UserParts

    cfg = _config(tmp_path / "x", strategy="single", nproc=1, **kw)
    with pytest.raises(ConfigError, match=match):
        cfg.validate()
        UserParts.from_config(cfg)
