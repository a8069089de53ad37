"""distrain train --strategy zero1|zero2|zero3: equal to one process, exact resume, layout checked."""

from __future__ import annotations

import os

import pytest
import torch

from distrain.errors import ConfigError
from distrain.trainer import train
from distrain.trainer.metrics import read_metrics

from conftest import reference_losses, trainer_config


def _losses(cfg) -> list[float]:
    return [r["loss"] for r in read_metrics(os.path.join(cfg.out, "metrics.jsonl"))]


@pytest.mark.timeout(400)
def test_zero_strategies_equal_single_process(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")
    for strategy, nproc, alg in [("zero1", 3, "ring"), ("zero2", 2, "tree"), ("zero3", 3, "ring")]:
        cfg = trainer_config(tmp_path / f"{strategy}{nproc}", strategy=strategy, nproc=nproc, algorithm=alg,
                             eval_every=5)
        summary = train(cfg)
        got = _losses(cfg)
        assert len(got) == len(ref) == 5
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-11, atol=0,
                                   msg=lambda m: f"{strategy} x{nproc} ({alg}) vs single: {m}")
        assert summary["label"] == f"{strategy} ({alg})"


@pytest.mark.timeout(400)
def test_zero3_resume_continues_exactly_and_layout_is_checked(tmp_path):
    full = trainer_config(tmp_path / "full", strategy="zero3", nproc=2, steps=6, dtype="float32")
    train(full)
    part = trainer_config(tmp_path / "part", strategy="zero3", nproc=2, steps=3, dtype="float32")
    train(part)
    resumed = trainer_config(tmp_path / "part", strategy="zero3", nproc=2, steps=6, dtype="float32", resume=True)
    train(resumed)
    assert _losses(resumed) == _losses(full)
    other = trainer_config(tmp_path / "part", strategy="zero2", nproc=2, steps=8, dtype="float32", resume=True)
    with pytest.raises(ConfigError, match=r"layout \{'zero': 3, 'dp': 2\}, this run uses \{'zero': 2, 'dp': 2\}"):
        train(other)


@pytest.mark.timeout(300)
def test_zero3_with_gradient_clipping_equals_single_process(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare", grad_clip=0.1)
    assert ref[1:] != reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")[1:]  # clipping acts
    cfg = trainer_config(tmp_path / "clip", strategy="zero3", nproc=3, grad_clip=0.1)
    train(cfg)
    torch.testing.assert_close(torch.tensor(_losses(cfg)), torch.tensor(ref), rtol=1e-11, atol=0)
