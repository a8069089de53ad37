"""Context parallelism through the trainer equals one process (fp64, rtol 1e-10): cp2 with the ring
and the all-to-all, cp2 x dp2, cp2 x tp2, cp2 x pp2, cp2 with ZeRO-2, cp4; the GPT and the Llama
(grouped-query attention, rotary positions); training losses and the validation losses of a
mid-run and a final evaluation. Also the trainer's one-line refusals of --cp before any rank
starts, and --elastic along dp with cp in the model replica."""

from __future__ import annotations

import pytest

import distrain
from distrain.errors import ConfigError
from distrain.trainer.metrics import read_metrics

from conftest import EVAL, assert_refused, assert_rows_equal, reference_rows, train_rows, trainer_config


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model,layout", [
    ("gpt-tiny", dict(cp=2, nproc=2)),
    ("gpt-tiny", dict(cp=2, nproc=2, cp_algorithm="all-to-all")),
    ("gpt-tiny", dict(cp=2, dp=2, nproc=4)),
    ("gpt-tiny", dict(cp=2, tp=2, nproc=4)),
    ("gpt-tiny", dict(cp=2, pp=2, nproc=4, microbatches=2)),
    ("gpt-tiny", dict(cp=2, nproc=2, strategy="zero2")),
    ("gpt-tiny", dict(cp=4, nproc=4)),
    ("llama-tiny", dict(cp=2, nproc=2, cp_algorithm="all-to-all")),  # 4 heads, 2 kv heads: 2 and 1 per rank
    ("llama-tiny", dict(cp=2, tp=2, nproc=4)),
], ids=lambda v: v if isinstance(v, str) else "-".join(f"{k}{v}" for k, v in v.items()))
def test_trainer_context_parallel_equals_one_process(tmp_path, tmp_path_factory, model, layout):
    ref = reference_rows(tmp_path_factory, model=model)
    got = train_rows(trainer_config(tmp_path / "cp", model=model, **EVAL, **layout))
    assert_rows_equal(got, ref, rel=1e-10)


@pytest.mark.parametrize("kw,message", [
    (dict(cp=3, nproc=3), "context parallelism (cp=3) cuts gpt-tiny's sequence (block_size) into 2 x cp = 6 equal "
                          "chunks (causal load balancing gives rank i the chunks i and 5-i), but 16 tokens do not "
                          "divide by 6: choose cp among 1, 2, 4, 8, or a length that is a multiple of 6"),
    (dict(cp=8, nproc=8, cp_algorithm="all-to-all"),
     "context parallelism (cp=8, all-to-all) does not fit gpt-tiny: the all-to-all gives every rank whole heads, but "
     "n_head=4 is not divisible by cp=8; choose cp among 1, 2, 4, or the ring variant (--cp-algorithm ring), which "
     "splits no heads"),
    (dict(model="llama-tiny", cp=2, tp=2, nproc=4, cp_algorithm="all-to-all"),
     "but n_kv_head=1 per tp rank (tp=2) is not divisible by cp=2; choose cp among 1, or the ring variant"),
    (dict(model="llama-tiny", cp=2, dp=2, nproc=4, cp_algorithm="all-to-all"), None),  # fits: 4 heads, 2 kv heads
    (dict(model="llama-tiny", cp=4, nproc=4, cp_algorithm="all-to-all"),
     "context parallelism (cp=4, all-to-all) does not fit llama-tiny: the all-to-all gives every rank whole heads, "
     "but n_kv_head=2 is not divisible by cp=4; choose cp among 1, 2, or the ring variant"),
    (dict(model="mlp-tiny", data="digits", cp=2, nproc=2), "--tp/--pp/--cp split the GPT and Llama models"),
    (dict(cp=2, nproc=3), r"dp*cp*tp*pp = 1*2*1*1 = 2 does not equal the world size 3"),
    (dict(cp=2, nproc=2, cp_algorithm="stripes"), "--cp-algorithm 'stripes' is unknown; use ring or all-to-all"),
    (dict(cp=2, nproc=2, strategy="ps-sync"), "--dp/--tp/--pp/--cp compose with --strategy ddp only"),
    (dict(cp=0, nproc=2), "--tp, --pp, --cp, --ep and --microbatches must be >= 1"),
])
def test_bad_cp_is_refused_before_any_rank_starts(tmp_path, kw, message):
    assert_refused(trainer_config(tmp_path / "bad", **kw), message)


def test_your_model_is_checked_against_cp_in_the_caller(tmp_path):
    import torch.nn as nn

    from distrain.models import build_model

    cfg = trainer_config(tmp_path / "own", cp=2, nproc=2)
    with pytest.raises(ConfigError, match=r"--cp 2: Sequential has no context-parallel plan .* or use --cp 1"):
        distrain.train(model=nn.Sequential(nn.Linear(4, 4)), config=cfg)
    with pytest.raises(ConfigError, match=r"cp=3\) cuts GPT's sequence \(block_size\) into 2 x cp = 6 equal chunks"):
        distrain.train(model=build_model("gpt-tiny"), config=trainer_config(tmp_path / "own3", cp=3, nproc=3))
    with pytest.raises(ConfigError, match=r"context parallelism \(cp=2\) does not support the GPT's attention dropout"):
        distrain.train(model=build_model("gpt-tiny", dropout=0.1), config=cfg)
    with pytest.raises(ConfigError, match=r"n_head=1 per tp rank \(tp=4\) is not divisible by cp=2"):
        distrain.train(model=build_model("gpt-tiny"), config=trainer_config(tmp_path / "own4", cp=2, tp=4, nproc=8,
                                                                             cp_algorithm="all-to-all"))
    assert not any((tmp_path / d).exists() for d in ("own", "own3", "own4"))  # nothing started


def test_elastic_accepts_cp_in_the_model_replica(tmp_path):
    from distrain.elastic import check

    ok = trainer_config(tmp_path / "e", cp=2, nproc=4, elastic="2:4", batch_size=12)
    assert check(ok) == (2, 4)
    with pytest.raises(ConfigError, match=r"MIN 3 is not a multiple of --cp 2 x --tp 1 x --pp 1 = 2 ranks per model "
                                          r"replica"):
        check(trainer_config(tmp_path / "e", cp=2, nproc=4, elastic="3:4"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_elastic_dp2_cp2_a_lost_rank_takes_its_replica_out(tmp_path, tmp_path_factory, monkeypatch):
    """ids 0, 1 are replica 0 (cp ranks 0, 1), ids 2, 3 replica 1: id 1 is SIGKILLed at step 2, id 0 is
    ended with it, and ids 2, 3 go on as dp1 x cp2 with the whole global batch: the losses of one process."""
    from conftest import reference_losses
    from distrain.trainer.metrics import read_events

    monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", "1@2")
    cfg = trainer_config(tmp_path / "run", strategy="ddp", collective_timeout=30, report=False, nproc=4, cp=2,
                         elastic="2:4")
    summary = distrain.train(cfg)
    path = tmp_path / "run" / "metrics.jsonl"
    losses, ref = [r["loss"] for r in read_metrics(path)], reference_losses(tmp_path_factory)
    assert losses == pytest.approx(ref, rel=1e-10, abs=0)
    (e,) = read_events(path)
    assert (e["old_world"], e["new_world"], e["left"], e["step"], e["rolled_back"]) == (4, 2, [0, 1], 2, 2)
    assert summary["world_final"] == 2
