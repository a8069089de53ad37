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
    with pytest.raises(ConfigError, match=r"layout \{'dp': 2, 'tp': 1, 'pp': 1, 'zero': 3\}, this run uses \{'dp': 2, 'tp': 1, "
                                          r"'pp': 1, 'zero': 2\}"):
        train(other)


@pytest.mark.timeout(300)
def test_zero3_with_gradient_clipping_equals_single_process(tmp_path, tmp_path_factory):
    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare", grad_clip=0.1)
    assert ref[1:] != reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")[1:]  # clipping acts
    cfg = trainer_config(tmp_path / "clip", strategy="zero3", nproc=3, grad_clip=0.1)
    train(cfg)
    torch.testing.assert_close(torch.tensor(_losses(cfg)), torch.tensor(ref), rtol=1e-11, atol=0)


def _as_written_before_the_grid_engine(out) -> None:
    """Rewrite run folder ``out`` (a ZeRO run on the dp ranks alone) as the ZeRO engine of before wrote it:
    shard ``zero-rank{r}`` in place of ``tp0-pp0-dp{r}``, the layout ``{"zero": N, "dp": P}``."""
    import json
    import re
    from pathlib import Path

    from distrain.checkpoint import store

    out = Path(out)
    manifest = json.loads((out / store.MANIFEST).read_text())
    files, sums = [], {}
    for name in manifest["files"]:
        d = re.fullmatch(r"checkpoint-\d+-tp0-pp0-dp(\d+)\.pt", name).group(1)
        state = store.load(out / name)
        state["shard"] = f"zero-rank{d}"
        state.pop("tp", None)  # (the engine of before recorded no tensor-parallel slices)
        old = store.save(out / store.shard_file(manifest["step"], f"zero-rank{d}"), state)
        (out / name).unlink()
        files.append(old.name)
        sums[old.name] = store.sha256(old)
    manifest.update(files=sorted(files), sha256=sums,
                    layout={"zero": manifest["layout"]["zero"], "dp": manifest["layout"]["dp"]})
    store.write_manifest(out, manifest)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_zero_run_written_before_the_grid_engine_resumes_exactly(tmp_path):
    """ZeRO on the dp ranks alone now runs in the grid engine, whose shards are ``tp0-pp0-dp{d}`` like every
    ZeRO layout's; a run folder the ZeRO engine of before wrote (``zero-rank{r}``, layout {"zero": 2, "dp":
    2}) still resumes, continuing exactly, and --reshard reads it into another layout."""
    import dataclasses

    full = trainer_config(tmp_path / "full", strategy="zero2", nproc=2, steps=6, dtype="float32")
    train(full)
    part = trainer_config(tmp_path / "part", strategy="zero2", nproc=2, steps=3, dtype="float32")
    train(part)
    assert sorted(p for p in os.listdir(part.out) if p.startswith("checkpoint-")) == [
        "checkpoint-00000003-tp0-pp0-dp0.pt", "checkpoint-00000003-tp0-pp0-dp1.pt"]
    _as_written_before_the_grid_engine(part.out)
    train(dataclasses.replace(part, steps=6, resume=True))
    assert _losses(part) == _losses(full)
    assert sorted(p for p in os.listdir(part.out) if p.startswith("checkpoint-")) == [
        "checkpoint-00000006-tp0-pp0-dp0.pt", "checkpoint-00000006-tp0-pp0-dp1.pt"]  # the old names superseded
    again = trainer_config(tmp_path / "again", strategy="zero2", nproc=2, steps=3, dtype="float32")
    train(again)
    _as_written_before_the_grid_engine(again.out)
    resharded = dataclasses.replace(again, strategy="ddp", nproc=3, steps=6, resume=True, reshard=True)
    train(resharded)  # the old ZeRO set consolidated and cut for three DDP replicas
    torch.testing.assert_close(torch.tensor(_losses(resharded)), torch.tensor(_losses(full)), rtol=2e-5, atol=0)
