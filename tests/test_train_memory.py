"""`distrain train` refuses, before any rank starts, a job whose ranks cannot hold the model in this host's
available memory (trainer/checks/memory.py): one line with the estimate, the memory available and the flags
that would fit; the estimate is a lower bound (weights, gradients, optimizer states as the strategies keep
them), so no job that fits is refused."""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from distrain.errors import ConfigError
from distrain.trainer import TrainConfig
from distrain.trainer.checks.memory import Job, fixes

GPT_SMALL = 867_072  # gpt-small's parameters (tests/test_costmodel.py)
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu"}


def test_lower_bound_counts_what_each_strategy_holds():
    n, b = 1000, 4
    ddp = Job(n, n, "float32", "ddp", 4, 1, 1, "adamw", 0.9)
    assert ddp.lower_bound() == 4 * b * (n + n + 2 * n)  # every rank: weights, gradients, AdamW's 2 moments
    assert replace(ddp, strategy="zero1").lower_bound() == b * (4 * n + 4 * n + 2 * n)  # states sharded
    assert replace(ddp, strategy="zero2").lower_bound() == b * (4 * n + n + 2 * n)  # and gradients
    assert replace(ddp, strategy="zero3").lower_bound() == b * (n + n + 2 * n)  # and weights: one copy in all
    assert replace(ddp, model_parallel=2).lower_bound() == 2 * b * 4 * n  # tp x pp = 2: two replicas
    assert replace(ddp, optimizer="sgd").lower_bound() == 4 * b * 3 * n  # SGD's momentum
    assert replace(ddp, optimizer="sgd", momentum=0.0).lower_bound() == 4 * b * 2 * n  # no state
    assert replace(ddp, dtype="float64").lower_bound() == 2 * ddp.lower_bound()
    # 3 workers hold weights and gradients; the server one copy of the weights and the states
    assert replace(ddp, strategy="ps-sync").lower_bound() == b * (3 * 2 * n + n + 2 * n)
    assert Job(n, n // 2, "float32", "ddp", 1, 1, 1, "adamw", 0.9).lower_bound() == b * (n + 3 * (n // 2))  # frozen


def test_the_flags_that_would_fit_are_each_the_smallest_change():
    j = Job(GPT_SMALL, GPT_SMALL, "float32", "ddp", 4, 1, 1, "adamw", 0.9)  # 55.5 MB
    assert fixes(j, 40e6) == ["--strategy zero1", "--nproc 2", "--optimizer sgd --momentum 0"]
    assert fixes(j, 20e6) == ["--strategy zero3", "--nproc 1 --strategy single"]
    assert fixes(j, 8e6) == ["--strategy zero3 --optimizer sgd --momentum 0"]  # no one change: all at once
    assert fixes(j, 6e6) == []
    assert fixes(replace(j, dtype="float64"), 56e6) == ["--strategy zero2", "--nproc 2", "--optimizer sgd --momentum 0",
                                                 "--dtype float32"]


def test_a_job_over_the_memory_is_refused_in_one_line_with_what_would_fit():
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="gpt-small", nproc=4).validate(available_memory=20e6)
    assert str(e.value) == (
        "--model gpt-small needs at least 0.0555 GB of memory (867,072 float32 parameters, their gradients and "
        "AdamW's 2 states under --strategy ddp on 4 rank(s), no activations) and this host has 0.02 GB available; it "
        "would fit with --strategy zero3 or --nproc 1 --strategy single, or train a smaller model")
    TrainConfig(model="gpt-small", nproc=4, strategy="zero3").validate(available_memory=20e6)  # what it suggested
    TrainConfig(model="gpt-small", nproc=4).validate(available_memory=55.5e6)  # the bound is met: not refused
    TrainConfig(model="gpt-small", nproc=4).validate(available_memory=None)  # unknown: not checked
    TrainConfig(model="gpt-small", nproc=4).validate(launched=(0, 4), available_memory=1e6)  # ranks of a launch


def test_an_8b_model_is_refused_before_any_rank_starts(tmp_path, capsys):
    from distrain.cli import main
    from distrain.runtime import available_memory

    if (available_memory() or 0) >= 514e9:
        pytest.skip("this host has the memory for 4 ranks of an 8B model in float32 with AdamW")
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(LLAMA_3_8B))
    out = tmp_path / "run"
    t0 = time.perf_counter()
    code = main(["train", "--model", f"hf:{tmp_path / 'llama-3-8b'}", "--nproc", "4", "--steps", "1", "--out",
                 str(out)])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith(f"distrain: error: --model hf:{tmp_path / 'llama-3-8b'} needs at least 514 GB of memory "
                          f"(8,030,261,248 float32 parameters, their gradients and AdamW's 2 states under --strategy "
                          f"ddp on 4 rank(s), no activations) and this host has ")
    assert err.endswith("train a smaller model\n")
    assert not out.exists()  # refused before the run folder (and any rank)
    assert took < 30, took  # the model counted on the meta device, nothing allocated


def test_the_python_api_refuses_it_too(tmp_path):
    """distrain.train(cfg) checks the host's memory as the command does (its edge reads MemAvailable)."""
    import distrain
    from distrain.errors import ConfigError
    from distrain.runtime import available_memory
    from distrain.trainer import TrainConfig

    if (available_memory() or 0) >= 514e9:
        pytest.skip("this host has the memory for 4 ranks of an 8B model in float32 with AdamW")
    (tmp_path / "llama-3-8b").mkdir()
    (tmp_path / "llama-3-8b" / "config.json").write_text(json.dumps(LLAMA_3_8B))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"^--model hf:\S+ needs at least 514 GB of memory \(8,030,261,248 float32 "):
        distrain.train(TrainConfig(model=f"hf:{tmp_path / 'llama-3-8b'}", nproc=4, steps=1, out=str(out)))
    assert not out.exists()
