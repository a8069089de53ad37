"""Checkpoints that reshard: a run saved with one layout (dp x tp x pp, ZeRO stage, nproc) resumes
under another with --reshard and continues with one process's losses (fp64); the sharded set
consolidates into one plain state_dict file (weights_only) and back (distrain checkpoint)."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import distrain
from distrain.cli import main as cli_main
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.trainer import TrainConfig, train
from distrain.trainer.metrics import read_metrics

from conftest import reference_losses, trainer_config

K, STEPS = 3, 5  # save at step K under layout A, go on to STEPS under layout B


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]


def _cfg(out, strategy: str, dp: int, tp: int, pp: int, **kw):
    mesh = dict(dp=dp, tp=tp, pp=pp, microbatches=2 if pp > 1 else 1) if tp > 1 or pp > 1 else {}
    return trainer_config(out, strategy=strategy, nproc=dp * tp * pp, **mesh, **kw)


def _layout(out) -> dict:
    return json.loads((out / "checkpoint.json").read_text())["layout"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("a,b", [
    (("ddp", 2, 1, 1), ("zero2", 2, 2, 1)),    # replicas -> ZeRO-2 over dp inside tp
    (("zero1", 2, 1, 2), ("zero3", 3, 1, 1)),  # ZeRO-1 in a pipeline -> ZeRO-3 on 3 ranks (odd)
    (("zero3", 2, 2, 1), ("single", 1, 1, 1)),  # ZeRO-3 flat shards inside tp -> one process
    (("ddp", 1, 2, 2), ("zero1", 2, 1, 2)),    # tp x pp shards -> ZeRO-1 in a pipeline
])
def test_resume_under_another_layout_continues_like_one_process(tmp_path, tmp_path_factory, a, b):
    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")
    out = tmp_path / "run"
    train(_cfg(out, *a, steps=K))
    before = _layout(out)
    train(_cfg(out, *b, steps=STEPS, resume=True, reshard=True))
    got = _losses(out)
    assert len(got) == STEPS
    torch.testing.assert_close(torch.tensor(got[K:]), torch.tensor(ref[K:]), rtol=1e-11, atol=0,
                               msg=lambda m: f"{a} -> {b}, steps {K}..{STEPS - 1} vs one process: {m}")
    assert _layout(out) != before  # the final checkpoint is written in the new layout


@pytest.mark.timeout(300)
def test_reshard_refusals_name_the_rule(tmp_path):
    out = tmp_path / "run"
    train(_cfg(out, "single", 1, 1, 1, steps=1))
    with pytest.raises(ConfigError, match=r"this run uses \{'dp': 2, 'tp': 1, 'pp': 1\}; resume with the same "
                                          r"--dp/--tp/--pp .*or add --reshard to load it into this layout"):
        train(_cfg(out, "ddp", 2, 1, 1, steps=2, resume=True))
    with pytest.raises(ConfigError, match=r"--seed is 1 but the checkpoint .* was trained with 0"):
        train(_cfg(out, "ddp", 2, 1, 1, steps=2, resume=True, reshard=True, seed=1))
    with pytest.raises(ConfigError, match=r"--reshard: --strategy ps-sync keeps its state on parameter servers"):
        train(_cfg(out, "ps-sync", 2, 1, 1, steps=2, resume=True, reshard=True))
    with pytest.raises(ConfigError, match=r"--reshard loads a checkpoint into another layout: it needs --resume"):
        train(_cfg(tmp_path / "other", "ddp", 2, 1, 1, reshard=True))


@pytest.mark.timeout(600)
def test_consolidate_to_one_file_and_back(tmp_path, tmp_path_factory, capsys):
    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")
    single = tmp_path / "single"
    train(_cfg(single, "single", 1, 1, 1, steps=K))
    sharded = tmp_path / "sharded"
    train(_cfg(sharded, "zero3", 2, 2, 1, steps=K))
    assert cli_main(["checkpoint", "consolidate", str(sharded), "-o", str(tmp_path / "model.pt")]) == 0
    assert f"step {K}" in capsys.readouterr().out
    ck = torch.load(tmp_path / "model.pt", weights_only=True)
    model = build_model("gpt-tiny").double()
    model.load_state_dict(ck["model"])  # strict: every parameter, whole
    mine = torch.load(next(single.glob("checkpoint-*-tp0-pp0.pt")), weights_only=True)
    assert ck["model"].keys() == mine["model"].keys()
    for name, t in mine["model"].items():
        torch.testing.assert_close(ck["model"][name], t, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    order = [n for n, _ in model.named_parameters()]
    for i, st in mine["optimizer"]["state"].items():  # Adam's moments, cut back from the flat tp shards
        for key, atol in (("exp_avg", 1e-12), ("exp_avg_sq", 1e-15)):
            torch.testing.assert_close(ck["optimizer"]["state"][order[i]][key], st[key], rtol=1e-9, atol=atol)
        assert float(ck["optimizer"]["state"][order[i]]["step"]) == K
    # and back: the file becomes a run folder, resumed in another layout
    back = tmp_path / "back"
    assert cli_main(["checkpoint", "import", str(tmp_path / "model.pt"), "--out", str(back)]) == 0
    assert _layout(back) == {"consolidated": True}
    train(_cfg(back, "ddp", 2, 1, 1, steps=STEPS, resume=True, reshard=True))
    torch.testing.assert_close(torch.tensor(_losses(back)), torch.tensor(ref[K:]), rtol=1e-11, atol=0)
    assert cli_main(["checkpoint", "consolidate", str(tmp_path / "none"), "-o", str(tmp_path / "x.pt")]) == 2
    assert "is not a run folder" in capsys.readouterr().err


class Counting(nn.Module):
    """Your own model with a persistent buffer that changes every training step and scales the
    output: a resume that lost the buffer (ZeRO shards parameters only) would change the losses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)])
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        if self.training:
            self.calls += 1
        for layer in self.layers:
            x = layer(x)
        return x * (1 + 0.1 * self.calls)


@pytest.mark.timeout(400)
def test_zero_checkpoints_keep_the_buffers(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (96,), generator=g))

    def run(out, **kw):
        cfg = TrainConfig(**{**dict(steps=STEPS, batch_size=12, lr=0.05, dtype="float64", eval_every=0,
                                    progress=False, report=False, log_every=1, out=str(out), timeout=120), **kw})
        distrain.train(model=Counting(), train_data=data, loss_fn=F.cross_entropy, config=cfg)
        return _losses(out)

    ref = run(tmp_path / "single", strategy="single", nproc=1)
    run(tmp_path / "same", strategy="zero2", nproc=2, steps=K)
    same = run(tmp_path / "same", strategy="zero2", nproc=2, resume=True)  # the same layout
    run(tmp_path / "other", strategy="zero3", nproc=3, steps=K)
    other = run(tmp_path / "other", strategy="single", nproc=1, resume=True, reshard=True)
    for name, got in (("zero2 -> zero2", same), ("zero3 x3 -> single", other)):
        torch.testing.assert_close(torch.tensor(got[K:]), torch.tensor(ref[K:]), rtol=1e-10, atol=0,
                                   msg=lambda m: f"{name}: {m}")
