"""The usual training features: LR warm-up and cosine decay, gradient clipping by the global
norm (also across tensor and pipeline shards), gradient accumulation, bf16 autocast,
classifier accuracy, --config run.toml, config.json, timestamps and lr in metrics.jsonl."""

from __future__ import annotations

import json
import math
import os
import time

import pytest
import torch

from distrain.cli import main
from distrain.errors import ConfigError
from distrain.trainer import train
from distrain.trainer.metrics import read_metrics
from distrain.trainer.task import lr_at

from conftest import reference_losses, train_losses, trainer_config


def test_lr_warmup_then_cosine_decay():
    cfg = trainer_config("x", lr=1.0, steps=10, warmup_steps=4, lr_schedule="cosine", min_lr=0.1)
    got = [lr_at(cfg, s) for s in range(10)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warm-up, reaching lr at the last warm-up step
    # cosine from lr to min_lr over the remaining steps: 0.1 + 0.9 * (1 + cos(pi * k / 6)) / 2
    want = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 6)) / 2 for k in range(0, 6)]
    assert got[4:] == pytest.approx(want, abs=1e-15)
    assert [lr_at(trainer_config("x", lr=0.3), s) for s in (0, 5)] == [0.3, 0.3]


@pytest.mark.timeout(100)
def test_metrics_carry_lr_and_time_and_config_json_is_written(tmp_path):
    t0 = time.time()
    cfg = trainer_config(tmp_path / "run", strategy="single", nproc=1, model="mlp-tiny", data="digits", steps=4,
                         batch_size=8, lr=0.5, warmup_steps=2, eval_every=2)
    train(cfg)
    rows = read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
    assert [r["lr"] for r in rows] == [0.25, 0.5, 0.5, 0.5]
    assert all(t0 <= r["time"] <= time.time() for r in rows)
    # a classifier reports accuracy beside the validation loss: 8 batches of 8 images
    acc = [r["val_accuracy"] for r in rows if "val_accuracy" in r]
    assert len(acc) == 2 and all(k / 64 == a for a in acc for k in [round(a * 64)])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved == cfg.to_dict()


@pytest.mark.timeout(300)
def test_accumulation_and_clipping_equal_single_process(tmp_path, tmp_path_factory):
    # 2 ranks x 3 accumulated micro-batches (no_sync on all but the last) == one process, one batch;
    # the clipping threshold is low enough that every step is clipped
    ref = reference_losses(tmp_path_factory, grad_clip=0.05)
    for strategy in ("ddp", "torch-ddp"):
        got = train_losses(trainer_config(tmp_path / strategy, strategy=strategy, nproc=2, accum_steps=3,
                                          grad_clip=0.05))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-10, atol=0,
                                   msg=lambda m: f"{strategy}: {m}")
    unclipped = reference_losses(tmp_path_factory)
    assert unclipped[1:] != ref[1:]  # the clipping did change the run


@pytest.mark.timeout(300)
def test_clipping_uses_the_global_norm_across_tp_and_pp_shards(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory, steps=4, grad_clip=0.05)
    for dp, tp, pp in [(1, 2, 1), (1, 1, 2)]:
        got = train_losses(trainer_config(tmp_path / f"mp{tp}{pp}", nproc=dp * tp * pp, dp=dp, tp=tp, pp=pp,
                                          microbatches=2, steps=4, grad_clip=0.05))
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-10, atol=0,
                                   msg=lambda m: f"tp={tp} pp={pp}: {m}")


@pytest.mark.timeout(100)
def test_bf16_autocast_trains_close_to_fp32(tmp_path):
    kw = dict(strategy="single", nproc=1, model="mlp-tiny", data="digits", steps=6, batch_size=16, dtype="float32")
    fp32 = train_losses(trainer_config(tmp_path / "fp32", **kw))
    bf16 = train_losses(trainer_config(tmp_path / "bf16", autocast="bf16", **kw))
    assert bf16 != fp32  # the matmuls really ran in bf16 ...
    torch.testing.assert_close(torch.tensor(bf16), torch.tensor(fp32), rtol=0.03, atol=0)  # ... and agree to bf16


@pytest.mark.parametrize("kw,match", [
    (dict(accum_steps=5), r"--accum-steps 5 does not divide the per-rank batch 12 / 1 = 12"),
    (dict(autocast="bf16"), r"--autocast bf16 needs --dtype float32"),
    (dict(strategy="ddp", nproc=2, tp=2, accum_steps=2), r"--accum-steps applies to single, ddp and torch-ddp"),
    (dict(grad_clip=-1.0), r"--grad-clip must be >= 0"),
    (dict(warmup_steps=-1), r"--warmup-steps must be >= 0"),
    (dict(lr_schedule="step"), r"--lr-schedule 'step' is unknown; use one of constant, cosine"),
])
def test_bad_feature_flags(tmp_path, kw, match):
    base = dict(strategy="single", nproc=1)
    base.update(kw)
    with pytest.raises(ConfigError, match=match):
        trainer_config(tmp_path / "bad", **base).validate()


@pytest.mark.timeout(100)
def test_config_file_with_flags_overriding_it(tmp_path, capsys):
    toml = tmp_path / "run.toml"
    toml.write_text('strategy = "single"\nnproc = 1\nmodel = "mlp-tiny"\ndata = "digits"\nsteps = 9\n'
                    'batch-size = 8\nlr = 0.25\nprogress = false\nsample_chars = 0\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(toml), "--steps", "3", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["steps"], saved["lr"], saved["batch_size"], saved["model"]) == (3, 0.25, 8, "mlp-tiny")
    toml.write_text('model = "mlp-tiny"\nbatch_sise = 8\n')
    assert main(["train", "--config", str(toml)]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"distrain: error: --config {toml}: unknown setting 'batch_sise'; settings are the train flags' names "
        f"(e.g. batch-size or batch_size)")


@pytest.mark.timeout(100)
def test_tensorboard_event_log(tmp_path):
    pytest.importorskip("tensorboard", reason="the optional extra: pip install 'distrain[tensorboard]'")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = trainer_config(tmp_path / "run", strategy="single", nproc=1, model="mlp-tiny", data="digits", steps=3,
                         batch_size=8)
    losses = train_losses(cfg)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [0, 1, 2]
    assert [e.value for e in events.Scalars("loss")] == pytest.approx(losses, rel=1e-6)  # stored as float32
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([1e-2] * 3)


@pytest.mark.timeout(150)
def test_pipeline_trace_and_gantt(tmp_path):
    trace, gantt = tmp_path / "trace.json", tmp_path / "gantt.png"
    train(trainer_config(tmp_path / "run", nproc=2, pp=2, microbatches=2, steps=2, trace=str(trace), gantt=str(gantt)))
    events = json.loads(trace.read_text())["traceEvents"]
    ops = {(e["pid"], e["name"]) for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B")}
    assert ops == {(s, f"{k}{m}") for s in (0, 1) for k in "FB" for m in (0, 1)}  # 2 stages x 2 micro-batches
    assert gantt.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and gantt.stat().st_size > 1000
    with pytest.raises(ConfigError, match=r"--trace/--gantt draw a pipeline's timeline: they need --pp >= 2, got "
                                          r"--pp 1"):
        trainer_config(tmp_path / "x", strategy="single", nproc=1, trace=str(trace)).validate()
