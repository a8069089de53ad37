"""A Hugging Face LlamaForCausalLM (and Qwen2, Mistral) under distrain's tensor and pipeline
parallelism, unchanged: tp=2, pp=2 (cut from its decoder layers by pipeline_layers) and dp2 x tp2
equal one process in fp64 over AdamW steps (losses and final parameters); the trainer through
distrain.train(model=hf_model, TrainConfig(tp=2)); a tp that does not divide the KV heads refused
before any rank starts; what distrain does with HF's own tp_plan."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from conftest import run_ranks

transformers = pytest.importorskip("transformers")

import distrain  # noqa: E402
from distrain.errors import ConfigError  # noqa: E402
from distrain.models import lm_loss  # noqa: E402
from distrain.models.hf_transformers import (  # noqa: E402
    TiedHead, check_tp_fits, hf_tp_plan, pipeline_layers, translate_hf_tp_plan,
)
from distrain.models.registry import build_model, model_tp_plan, tp_plan_for  # noqa: E402
from distrain.parallel import parallelize  # noqa: E402
from distrain.topology import Topology  # noqa: E402
from distrain.trainer import TrainConfig  # noqa: E402
from distrain.trainer.metrics import read_metrics  # noqa: E402

B, T, STEPS, V = 4, 16, 3, 256
SIZES = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
KINDS = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}),
         "tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
         "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),        # biases on q/k/v
         "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8})}  # a sliding-window mask


def hf_model(kind: str = "llama", dtype=torch.float64, **over):
    cfg_cls, model_cls, extra = KINDS[kind]
    cfg = getattr(transformers, cfg_cls)(**{**SIZES, **extra, **over})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = getattr(transformers, model_cls)(cfg)
    with torch.no_grad():  # norms and biases away from their init, so a misplaced one would show
        for n, p in m.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)


def _batch(step: int, rows: slice = slice(None)):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, V, (B, T + 1), generator=g)
    return idx[rows, :-1], idx[rows, 1:]


def _reference(kind: str):
    """One process: losses and final parameters {HF name: tensor} after STEPS AdamW steps."""
    m = hf_model(kind)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in m.named_parameters()}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-11)


def _check_params(tag, pm, ref_params, hf_name, bad):
    names = set()
    for n, p in pm.module.named_parameters():
        full = hf_name(n)
        names.add(full)
        want = pm.tp_info[n].take(ref_params[full])
        if not _close(p.detach(), want):
            bad.append(f"{tag}: parameter {full} after {STEPS} steps differs by "
                       f"{(p.detach() - want).abs().max().item():.2e}")
    return names


# ---------------------------------------------------------------------------------------------
# Tensor parallelism (tp=2)
# ---------------------------------------------------------------------------------------------

def _tp_rank(rank: int) -> list[str]:
    bad: list[str] = []
    topo = Topology.from_world(dp=1, tp=2, pp=1)
    for kind in ("llama", "tied", "qwen2"):
        ref_losses, ref_params = _reference(kind)
        model = hf_model(kind)
        pm = parallelize(model, topo, loss_fn=lm_loss, tp_plan=model_tp_plan(model), algorithm="ring")
        attn = model.model.layers[0].self_attn
        heads = (attn.q_proj.out_features // attn.head_dim, attn.k_proj.out_features // attn.head_dim)
        if heads != (2, 1):
            bad.append(f"{kind}: local (query, kv) heads {heads}, expected (2, 1)")
        if kind == "tied" and not isinstance(model.lm_head, TiedHead):
            bad.append(f"tied: lm_head is a {type(model.lm_head).__name__}")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            if s == 0:
                shard = model(x).logits
                if shard.shape != (B, T, V // 2):
                    bad.append(f"{kind}: logits shard {tuple(shard.shape)}")
            loss = pm.train_step(x, y)
            if abs(loss.item() - ref_losses[s]) > 1e-10:
                bad.append(f"{kind} step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
            opt.step()
        names = _check_params(kind, pm, ref_params, lambda n: n, bad)
        if names != set(ref_params):
            bad.append(f"{kind}: parameters {sorted(names ^ set(ref_params))} on one side only")
    return [f"rank {rank}: {b}" for b in bad]


@pytest.mark.timeout(120)
def test_hf_tp2_equals_one_process():
    run_ranks(_tp_rank, 2, timeout=110)


# ---------------------------------------------------------------------------------------------
# Pipeline parallelism (pp=2), cut from the decoder layers
# ---------------------------------------------------------------------------------------------

def _pp_rank(rank: int) -> list[str]:
    bad: list[str] = []
    topo = Topology.from_world(dp=1, tp=1, pp=2)
    for kind in ("llama", "mistral"):
        ref_losses, ref_params = _reference(kind)
        pipe = pipeline_layers(hf_model(kind))
        pm = parallelize(pipe, topo, loss_fn=lm_loss, microbatches=2, schedule="1f1b")
        start = pm.stage.start
        if pm.stage.bounds != [(0, 2), (2, 4)]:
            bad.append(f"{kind}: stages cut at {pm.stage.bounds}")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            loss = pm.train_step(x, y)
            if pm.has_loss and abs(loss.item() - ref_losses[s]) > 1e-10:
                bad.append(f"{kind} step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
            opt.step()

        def hf_name(n: str) -> str:  # stage "layers.i.x" -> pipeline "layers.{start+i}.x" -> HF name
            head, i, rest = n.split(".", 2)
            return pipe.hf_name(f"{head}.{int(i) + start}.{rest}")

        _check_params(kind, pm, ref_params, hf_name, bad)
    return [f"rank {rank}: {b}" for b in bad]


@pytest.mark.timeout(120)
def test_hf_pp2_from_its_decoder_layers_equals_one_process():
    run_ranks(_pp_rank, 2, timeout=110)


# ---------------------------------------------------------------------------------------------
# dp2 x tp2 (P = 4)
# ---------------------------------------------------------------------------------------------

def _dp_tp_rank(rank: int) -> list[str]:
    bad: list[str] = []
    ref_losses, ref_params = _reference("llama")
    topo = Topology.from_world(dp=2, tp=2, pp=1)
    model = hf_model("llama")
    pm = parallelize(model, topo, loss_fn=lm_loss, tp_plan=model_tp_plan(model), algorithm="ring")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    half = B // 2
    for s in range(STEPS):
        x, y = _batch(s, slice(topo.dp_rank * half, (topo.dp_rank + 1) * half))
        opt.zero_grad()
        loss = pm.train_step(x, y)
        total = loss.clone()
        dist.all_reduce(total, group=topo.dp_group)  # the two halves' mean losses -> the batch's
        if abs(total.item() / 2 - ref_losses[s]) > 1e-10:
            bad.append(f"step {s}: loss {total.item() / 2!r} != {ref_losses[s]!r}")
        opt.step()
    _check_params("dp2xtp2", pm, ref_params, lambda n: n, bad)
    return [f"rank {rank}: {b}" for b in bad]


@pytest.mark.timeout(120)
def test_hf_dp2_tp2_equals_one_process():
    run_ranks(_dp_tp_rank, 4, timeout=110)


# ---------------------------------------------------------------------------------------------
# The trainer: distrain.train(model=hf_model, config=TrainConfig(tp=2))
# ---------------------------------------------------------------------------------------------

def _trainer_config(out, **kw) -> TrainConfig:
    base = dict(steps=3, batch_size=4, lr=1e-2, dtype="float64", eval_every=0, sample_chars=0, progress=False,
                report=False, log_every=1, out=str(out), timeout=110)
    return TrainConfig(**{**base, **kw})


@pytest.mark.timeout(120)
def test_trainer_tp2_on_shakespeare_equals_one_process(tmp_path):
    model = hf_model("llama", dtype=torch.float32)
    model.config.block_size = T  # the trainer's windows of text (an HF config has no block_size of its own)
    runs = {"single": dict(strategy="single", nproc=1), "tp2": dict(tp=2, nproc=2)}
    for name, kw in runs.items():
        distrain.train(model=model, config=_trainer_config(tmp_path / name, **kw))
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")] for name in runs}
    assert len(losses["single"]) == 3
    assert losses["tp2"] == pytest.approx(losses["single"], rel=1e-10, abs=1e-12)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # the caller's model is left as it was


def test_trainer_refuses_a_tp_that_does_not_divide_the_kv_heads_before_start(tmp_path):
    model = hf_model("llama", dtype=torch.float32, num_key_value_heads=1)
    model.config.block_size = T
    want = ("tensor parallelism (tp=2) does not fit LlamaForCausalLM: num_key_value_heads=1 is not divisible by "
            "tp=2 (grouped-query attention: every rank holds whole key/value heads, the ones its query heads use); "
            "choose tp among the divisors of 1: 1. (tp values that divide every size: 1)")
    with pytest.raises(ConfigError, match=re.escape(want) + "$"):
        distrain.train(model=model, config=_trainer_config(tmp_path / "run", tp=2, nproc=2))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no rank started


# ---------------------------------------------------------------------------------------------
# Pure parts: the plan lookup, HF's tp_plan, the pipeline wrapper's names, the size checks
# ---------------------------------------------------------------------------------------------

def test_hf_tp_plan_attribute_is_replaced_by_distrains_plan():
    m = hf_model("llama")
    assert set(m.tp_plan) and all(isinstance(v, str) for v in m.tp_plan.values())  # HF's, HF's styles
    plan = model_tp_plan(m)
    assert dict(plan.layers) == dict(hf_tp_plan(m).layers) and plan.loss is not None
    assert dict(tp_plan_for(pipeline_layers(m)).layers) == dict(plan.layers)
    tied = model_tp_plan(hf_model("tied"))
    assert "lm_head" not in tied.layers and "embed_tokens" in tied.layers and tied.loss is not None
    padded = model_tp_plan(hf_model("tied", pad_token_id=0))  # a padding row: embedding and tied head stay whole
    assert "embed_tokens" not in padded.layers and "lm_head" not in padded.layers and padded.loss is None


def test_hf_tp_plan_translation_is_exact_or_refused():
    m = hf_model("llama")
    plan = translate_hf_tp_plan(m.tp_plan, m)
    assert plan.styles["lm_head"].gather_output and plan.loss is None
    assert type(plan.styles["model.embed_tokens"]).__name__ == "VocabParallel"
    assert plan.styles["model.layers.*.self_attn.q_proj"].sync_input
    assert plan.match("model.layers.1.mlp.down_proj") == ["model.layers.*.mlp.down_proj"]
    with pytest.raises(ConfigError, match=r"style\(s\) \['local_colwise'\] have no exact distrain equivalent"):
        translate_hf_tp_plan({"model.layers.*.self_attn.q_proj": "local_colwise"}, m)
    with pytest.raises(ConfigError, match="names a parameter"):
        translate_hf_tp_plan({"model.layers.*.self_attn.q_proj.weight": "colwise"}, m)


def test_pipeline_layers_shares_the_tensors_and_maps_names_back():
    m = hf_model("mistral")
    pipe = pipeline_layers(m)
    assert len(pipe.layers) == 4
    hf_sd, ours = m.state_dict(), pipe.state_dict()
    assert set(pipe.to_hf_state_dict(ours)) == set(hf_sd)
    for n, t in ours.items():
        assert t.data_ptr() == hf_sd[pipe.hf_name(n)].data_ptr()  # the same storage: nothing copied
    assert pipe.hf_name("layers.1.layer.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert pipe.hf_name("layers.3.lm_head.weight") == "lm_head.weight"
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(pipe(ids), m(ids).logits)
    with pytest.raises(ConfigError, match="ties lm_head to embed_tokens"):
        pipeline_layers(hf_model("tied"))


def test_size_checks_read_hf_and_distrain_names():
    check_tp_fits(hf_model("llama"), 2)
    with pytest.raises(ConfigError, match=r"num_attention_heads=4 is not divisible by tp=8 \(every rank holds whole "
                                          r"query heads\).*num_key_value_heads=2 is not divisible by tp=8.*"
                                          r"\(tp values that divide every size: 1, 2\)$"):
        check_tp_fits(hf_model("llama"), 8)
    with pytest.raises(ConfigError, match=r"does not fit GPT: n_head=4 is not divisible by tp=3 .*n_embd=32 .*"
                                          r"vocab_size=256 .*\(tp values that divide every size: 1, 2, 4\)"):
        check_tp_fits(build_model("gpt-tiny"), 3)
