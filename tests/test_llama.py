"""distrain.models.llama: layout and presets, the Hugging Face adapter (logits equal to
transformers' LlamaForCausalLM, both ways), and the tensor/pipeline plan (tp=2, pp=2 equal one
process in fp64 over several AdamW steps; tp that does not fit the heads is refused)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from distrain import Topology
from distrain.data import encode
from distrain.errors import ConfigError
from distrain.models import build_model, count_parameters, generate, list_models, lm_loss
from distrain.models.llama import (
    Llama, LlamaConfig, check_llama_tp, config_from_hf, config_to_hf, from_hf, llama_tp_plan, state_dict_shapes,
    to_hf,
)
from distrain.models.registry import tp_plan_for
from distrain.parallel import parallelize
from distrain.parallel.tensor_parallel import TPGroup, apply_tensor_parallel, tp_shard_info

from conftest import expect_error, run_ranks

DT = torch.float64
STEPS, B, T = 3, 4, 16


def tiny(seed=0, **kw) -> Llama:
    torch.manual_seed(seed)
    return build_model("llama-tiny", **kw).to(DT)


def _batch(step: int, vocab: int = 256):
    g = torch.Generator().manual_seed(700 + step)
    ids = torch.randint(0, vocab, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


# ---------------------------------------------------------------------------------------------
# The model and its presets
# ---------------------------------------------------------------------------------------------

def test_layout_shapes_and_gqa_head_counts():
    m = tiny()
    c = m.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.intermediate_size, c.block_size) == (2, 4, 2, 64, 192, 32)
    assert len(m.layers) == c.n_layer + 2
    shapes = {n: tuple(p.shape) for n, p in m.state_dict().items()}
    assert shapes == state_dict_shapes(c)
    assert shapes["layers.1.attention.wk.weight"] == (32, 64) and shapes["layers.1.attention.wq.weight"] == (64, 64)
    assert shapes["layers.3.output.weight"] == (256, 64)
    assert all(not n.endswith("bias") for n in shapes)
    attn = m.layers[1].attention
    assert (attn.head_dim, attn.n_local_heads, attn.n_local_kv_heads) == (16, 4, 2)
    idx = torch.randint(0, 256, (3, 32))
    x = idx
    for layer in m.layers:  # the pipeline contract: forward is the loop over layers
        x = layer(x)
    logits = m(idx)
    assert logits.shape == (3, 32, 256) and logits.dtype == DT and torch.equal(logits, x)
    assert m(idx[:, :5]).shape == (3, 5, 256)
    with pytest.raises(ConfigError, match="exceeds block_size 32"):
        m(torch.zeros(1, 33, dtype=torch.long))


def test_causal():
    m = tiny()
    a = torch.randint(0, 256, (1, 20))
    b = a.clone()
    b[0, 12:] = (b[0, 12:] + 7) % 256
    assert torch.allclose(m(a)[:, :12], m(b)[:, :12], atol=1e-12)
    assert not torch.allclose(m(a)[:, 12:], m(b)[:, 12:])


def test_tied_head_shares_one_parameter_and_refuses_a_split_pipeline():
    m = tiny(tie_word_embeddings=True)
    assert count_parameters(m) == count_parameters(tiny()) - 256 * 64
    assert "layers.3.output.weight" not in m.state_dict()
    idx = torch.randint(0, 256, (2, 8))
    emb, head = m.layers[0], m.layers[-1]
    h = emb(idx)
    for layer in m.layers[1:-1]:
        h = layer(h)
    want = torch.nn.functional.linear(head.norm(h), emb.tok_embeddings.weight)
    assert torch.equal(m(idx), want)
    lm_loss(m(idx), idx).backward()  # one gradient: both uses summed into the embedding's
    assert emb.tok_embeddings.weight.grad is not None
    # a pipeline stage holding the head without the embedding would train a stale copy: refused
    lone = tiny(tie_word_embeddings=True).layers[-1]
    with pytest.raises(ConfigError, match="tie_word_embeddings.*different stages"):
        lone(torch.randn(2, 8, 64, dtype=DT))


def test_presets_registry_and_shape_only_sizes():
    names = set(list_models())
    assert {"llama-tiny", "llama-small", "smollm2-135m", "llama-3.2-1b", "llama-3-8b"} <= names
    assert count_parameters(build_model("llama-tiny")) == 131_392
    assert count_parameters(build_model("llama-small")) == 853_120  # gpt-small: 867,072
    published = {"smollm2-135m": 134_515_008, "llama-3.2-1b": 1_235_814_400, "llama-3-8b": 8_030_261_248}
    for name, n in published.items():
        with torch.device("meta"):  # no memory: shapes only
            assert count_parameters(build_model(name)) == n, name
    with torch.device("meta"):
        c = build_model("llama-3.2-1b").config
    assert c.tie_word_embeddings and c.rope_scaling["factor"] == 32.0 and c.n_kv_head == 8
    assert isinstance(tp_plan_for(build_model("llama-tiny")), type(llama_tp_plan()))
    with pytest.raises(ConfigError, match="no option.*n_layers"):
        build_model("llama-tiny", n_layers=3)


def test_cost_model_reads_the_presets_without_weights():
    from distrain.costmodel import plan

    m = plan.model_spec("llama-3-8b", None)
    assert (m.params, m.layers, m.hidden, m.heads) == (8_030_261_248, 32, 4096, 32)
    with pytest.raises(ConfigError, match="--compute-ms"):
        plan.measured_compute("llama-3-8b")


def test_a_larger_vocabulary_than_the_data_works():
    m = tiny(vocab_size=1000)
    x, y = _batch(0)  # byte-level ids < 256
    loss = lm_loss(m(x), y)
    loss.backward()
    assert m(x).shape == (B, T, 1000) and torch.isfinite(loss)
    out = generate(m, x[:1, :4], 6, temperature=0)
    assert out.shape == (1, 10)


def test_config_validation():
    with pytest.raises(ConfigError, match="not a multiple of n_kv_head 3"):
        LlamaConfig(n_head=4, n_kv_head=3)
    with pytest.raises(ConfigError, match="even head_dim"):
        LlamaConfig(n_embd=60, n_head=4)
    with pytest.raises(ConfigError, match="lacks.*low_freq_factor"):
        LlamaConfig(rope_scaling={"factor": 8.0})
    with pytest.raises(ConfigError, match="rope_type 'yarn' is not supported"):
        LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 8.0})


def test_llama_learns_tiny_repeated_text():
    m = tiny()
    data = encode("hello world! " * 20)
    x = torch.stack([data[i:i + 16] for i in range(0, 64, 4)])
    y = torch.stack([data[i + 1:i + 17] for i in range(0, 64, 4)])
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss = lm_loss(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# The Hugging Face adapter (pure parts: no transformers needed)
# ---------------------------------------------------------------------------------------------

def test_hf_config_both_rope_formats_and_round_trip():
    scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16)
    base = dict(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                tie_word_embeddings=True)
    v4 = dict(base, rope_theta=5e5, rope_scaling=dict(scaling, type="llama3"))        # transformers 4
    v5 = dict(base, rope_parameters=dict(scaling, rope_type="llama3", rope_theta=5e5))  # transformers 5
    a, b = config_from_hf(v4), config_from_hf(v5)
    assert a == b and a.rope_theta == 5e5 and a.rope_scaling == scaling and a.n_kv_head == 2 and a.tie_word_embeddings
    assert config_from_hf(config_to_hf(a)) == a
    assert config_from_hf(dict(base, rope_theta=1e4)).rope_scaling is None
    for bad, msg in ((dict(hidden_act="gelu"), "hidden_act='gelu'"), (dict(attention_bias=True), "attention_bias"),
                     (dict(model_type="mistral"), "model_type 'mistral'"),
                     (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "rope_type 'yarn'")):
        with pytest.raises(ConfigError, match=msg):
            config_from_hf(dict(base, **bad))


def test_hf_state_dict_errors_name_the_tensor():
    m = tiny()
    sd = m.state_dict()
    hf_sd, hf_cfg = to_hf(sd, m.config)
    assert "model.layers.1.mlp.up_proj.weight" in hf_sd and "lm_head.weight" in hf_sd
    cfg, back = from_hf(hf_sd, hf_cfg)
    assert cfg == m.config and back.keys() == sd.keys() and all(back[n] is sd[n] for n in sd)  # no copies
    missing = {k: v for k, v in hf_sd.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ConfigError, match=r"from_hf: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        from_hf(missing, hf_cfg)
    wrong = dict(hf_sd, **{"model.layers.0.self_attn.k_proj.weight": torch.zeros(64, 64)})
    with pytest.raises(ConfigError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(64, 64\), but "
                                          r"the config needs \(32, 64\).*num_key_value_heads"):
        from_hf(wrong, hf_cfg)
    extra = dict(hf_sd, **{"model.layers.2.mlp.up_proj.weight": torch.zeros(192, 64)})
    with pytest.raises(ConfigError, match=r"unexpected tensor 'model\.layers\.2\.mlp\.up_proj\.weight'.*"
                                          r"num_hidden_layers=2"):
        from_hf(extra, hf_cfg)
    ours = dict(m.state_dict())
    del ours["layers.2.ffn_norm.weight"]
    with pytest.raises(ConfigError, match=r"to_hf: missing tensor 'layers\.2\.ffn_norm\.weight'"):
        to_hf(ours, m.config)
    with pytest.raises(ConfigError, match="tie_word_embeddings=True but 'lm_head.weight' differs"):
        from_hf(hf_sd, dict(hf_cfg, tie_word_embeddings=True))


# ---------------------------------------------------------------------------------------------
# Against transformers' LlamaForCausalLM
# ---------------------------------------------------------------------------------------------

HF_CASES = {
    "gqa": dict(),
    "tied": dict(tie_word_embeddings=True),
    "llama3-rope": dict(rope_theta=500000.0,
                        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                          original_max_position_embeddings=16)),
}


def _hf_model(transformers, **kw):
    base = dict(vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg = transformers.LlamaConfig(**dict(base, **kw))
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():  # random norms too, so a swapped norm would show
        for n, p in m.named_parameters():
            p.add_(torch.randn_like(p) * (0.2 if "norm" in n else 0.05))
    return m


@pytest.mark.parametrize("case", list(HF_CASES))
def test_logits_equal_transformers_both_ways(case):
    transformers = pytest.importorskip("transformers")
    hf = _hf_model(transformers, **HF_CASES[case])
    cfg, sd = from_hf(hf.state_dict(), hf.config.to_dict())
    ours = Llama(cfg).eval()
    ours.load_state_dict(sd, strict=True)
    ids = torch.randint(0, 300, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    assert (want - got).abs().max().item() < 1e-5, (want - got).abs().max().item()
    assert want.abs().max() > 0.1  # not a trivial comparison
    if case == "llama3-rope":  # the scaling is exercised: without it the logits differ
        plain = Llama(LlamaConfig(**{**cfg.__dict__, "rope_scaling": None})).eval()
        plain.load_state_dict(sd)
        with torch.no_grad():
            assert (plain(ids) - want).abs().max() > 1e-3
    hf_sd, hf_cfg = to_hf(ours.state_dict(), cfg)
    c2 = transformers.LlamaConfig(**hf_cfg)
    c2._attn_implementation = "eager"
    back = transformers.LlamaForCausalLM(c2).eval()
    back.load_state_dict(hf_sd, strict=True)
    with torch.no_grad():
        again = back(ids).logits
    assert (again - got).abs().max().item() < 1e-5


# ---------------------------------------------------------------------------------------------
# Tensor and pipeline parallelism: equal to one process (fp64, AdamW)
# ---------------------------------------------------------------------------------------------

def _reference(over: dict):
    m = tiny(**over)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses, grads = [], []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, {n: p.detach() for n, p in m.named_parameters()}


def _compare(tag, module, info, full_name, step, grads, bad):
    for n, p in module.named_parameters():
        want = info[n].take(grads[full_name(n)])
        if not torch.allclose(p.grad, want, rtol=1e-9, atol=1e-12):
            bad.append(f"{tag} step {step} grad {n}: max diff {(p.grad - want).abs().max().item():.2e}")


def _tp_rank(rank: int) -> list[str]:
    bad: list[str] = []
    cases = [("plain", {}, None), ("sequence-parallel", {}, llama_tp_plan(sequence_parallel=True)),
             ("tied", {"tie_word_embeddings": True}, None)]
    tp = TPGroup(None, "ring")
    for tag, over, plan in cases:
        ref_losses, ref_grads, ref_params = _reference(over)
        model = tiny(**over)
        tpm = apply_tensor_parallel(model, None, "ring", plan=plan or tp_plan_for(model))
        plan = plan or tp_plan_for(model)
        opt = torch.optim.AdamW(tpm.parameters(), lr=1e-2)
        info = tp_shard_info(tpm)
        attn = tpm.layers[1].attention
        if (attn.n_local_heads, attn.n_local_kv_heads) != (2, 1):
            bad.append(f"{tag}: local heads {(attn.n_local_heads, attn.n_local_kv_heads)}, expected (2, 1)")
        for s in range(STEPS):
            x, y = _batch(s)
            opt.zero_grad()
            shard = tpm(x)
            if shard.shape != (B, T, 128):
                bad.append(f"{tag}: logits shard {tuple(shard.shape)}")
            loss = plan.loss(shard, y, tp)
            loss.backward()
            if abs(loss.item() - ref_losses[s]) > 1e-10:
                bad.append(f"{tag} step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
            _compare(tag, tpm, info, lambda n: n, s, ref_grads[s], bad)
            opt.step()
        for n, p in tpm.named_parameters():
            if not torch.allclose(p.detach(), info[n].take(ref_params[n]), rtol=1e-9, atol=1e-12):
                bad.append(f"{tag}: parameter {n} after {STEPS} steps differs")
    # grouped-query attention: tp=2 does not divide n_kv_head=1: refused before any change
    one_kv = tiny(n_kv_head=1)
    bad.append(expect_error(lambda: apply_tensor_parallel(one_kv, None, "ring", plan=llama_tp_plan()), ConfigError,
                            "n_kv_head=1 is not divisible by tp=2", "whole key/value heads",
                            "tp values that divide every size: 1"))
    if not isinstance(one_kv.layers[1].attention.wq, nn.Linear) or type(one_kv.layers[0].tok_embeddings) is not \
            nn.Embedding:
        bad.append("a refused plan changed the model")
    return [f"rank {rank}: {b}" for b in bad if b]


@pytest.mark.timeout(90)
def test_tp2_equals_one_process():
    run_ranks(_tp_rank, 2, timeout=80)


def _pp_rank(rank: int) -> list[str]:
    ref_losses, ref_grads, ref_params = _reference({})
    topo = Topology.from_world(dp=1, tp=1, pp=2)
    pm = parallelize(tiny(), topo, loss_fn=lm_loss, microbatches=2, schedule="1f1b")
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    start = pm.stage.start

    def full_name(n: str) -> str:  # stage "layers.i.x" -> model "layers.{start+i}.x"
        head, i, rest = n.split(".", 2)
        return f"{head}.{int(i) + start}.{rest}"

    info = tp_shard_info(pm.module)
    bad: list[str] = []
    if pm.stage.bounds != [(0, 2), (2, 4)]:
        bad.append(f"stages cut at {pm.stage.bounds}")
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = pm.train_step(x, y)
        if pm.has_loss and abs(loss.item() - ref_losses[s]) > 1e-10:
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
        _compare("pp2", pm.module, info, full_name, s, ref_grads[s], bad)
        opt.step()
    for n, p in pm.module.named_parameters():
        if not torch.allclose(p.detach(), ref_params[full_name(n)], rtol=1e-9, atol=1e-12):
            bad.append(f"parameter {n} after {STEPS} steps differs")
    return [f"rank {rank}: {b}" for b in bad]


@pytest.mark.timeout(90)
def test_pp2_equals_one_process():
    run_ranks(_pp_rank, 2, timeout=80)


def test_tp_that_does_not_fit_the_kv_heads_is_refused():
    m = build_model("llama-tiny")
    check_llama_tp(m, 2)
    with pytest.raises(ConfigError, match=r"n_kv_head=2 is not divisible by tp=4 \(grouped-query attention.*"
                                          r"choose tp among the divisors of 2: 1, 2.*tp values that divide every "
                                          r"size: 1, 2\)"):
        check_llama_tp(m, 4)
    with pytest.raises(ConfigError, match="gather_logits=True.*tied"):
        check_llama_tp(build_model("llama-tiny", tie_word_embeddings=True), 2, gather_logits=True)


def test_plan_seq_len_for_shape_only_presets(capsys):
    """`distrain plan --seq-len` overrides the preset's 8192-token context in the activation estimate."""
    from distrain.cli import main

    args = ["plan", "--model", "smollm2-135m", "--nodes", "2", "--procs-per-node", "2", "--link", "ib-hdr",
            "--intra", "nvlink3", "--batch-size", "16", "--compute-ms", "1000"]
    assert main(args + ["--seq-len", "1024"]) == 0
    short = capsys.readouterr().out
    assert main(args) == 0
    full = capsys.readouterr().out

    def ddp_mem(out):
        row = next(line for line in out.splitlines() if "ddp ring" in line)
        return float(row.split()[-2])

    assert ddp_mem(short) < ddp_mem(full) / 10  # the s^2 attention term shrinks 64x, the s term 8x
    assert main(args + ["--seq-len", "0"]) != 0
    assert "--seq-len 0: give a positive length, for a transformer preset" in capsys.readouterr().err


# every way of training, on the Llama preset, through the trainer: equal to one process (fp64)
LLAMA_LAYOUTS = {
    "ddp": dict(strategy="ddp", nproc=2), "torch-ddp": dict(strategy="torch-ddp", nproc=2),
    "zero1": dict(strategy="zero1", nproc=2), "zero2": dict(strategy="zero2", nproc=3),
    "zero3": dict(strategy="zero3", nproc=2), "ps-sync": dict(strategy="ps-sync", nproc=3),
    "pp2-gpipe": dict(strategy="ddp", nproc=2, pp=2, microbatches=2, schedule="gpipe"),
    "pp2-zb-h1": dict(strategy="ddp", nproc=2, pp=2, microbatches=2, schedule="zb-h1"),
    "dp1xtp2xpp2": dict(strategy="ddp", nproc=4, tp=2, pp=2, microbatches=2),
    "zero1-dp2xpp2": dict(strategy="zero1", nproc=4, dp=2, pp=2, microbatches=2),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(LLAMA_LAYOUTS))
def test_llama_tiny_every_strategy_equals_one_process(tmp_path, tmp_path_factory, name):
    from conftest import reference_losses, train_losses, trainer_config

    ref = reference_losses(tmp_path_factory, model="llama-tiny")
    got = train_losses(trainer_config(tmp_path / name, model="llama-tiny", **LLAMA_LAYOUTS[name]))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-10, atol=0,
                               msg=lambda m: f"{name}: {got} vs one process {ref}: {m}")
