"""--layout-invariant: the same bits on one process or many (docs/determinism.md).

Every run here is float32 (or bf16 autocast) and compared with ``==`` and ``torch.equal``: every step's
loss as written to metrics.jsonl (a float64 that JSON keeps exactly), and the consolidated final state
(parameters and every optimizer state tensor), against the one-process run of the same job. No tolerance
anywhere: a difference of one bit fails.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn

from conftest import assert_bitwise, consolidated_state, invariant_matrix, train_losses, trainer_config

# the matrix: every step's loss == one process's and the final state torch.equal; a layout whose sums fell in
# another order differs from the first step on (the clip acts at every step). 10 steps, not 30: the suite's
# layouts trained ~2 minutes of `make test` on this 2-core host, most of it steps
STEPS = 10


def job(out, **kw):
    """A float32 gpt-tiny job with --layout-invariant, 12 units of one sample, clipped (the norm is exact too)."""
    base = dict(dtype="float32", layout_invariant=True, units=12, steps=STEPS, grad_clip=0.5, log_every=10)
    return trainer_config(out, **{**base, **kw})


_REFERENCES: dict = {}


def reference(tmp_path_factory, **kw):
    """The one-process run of ``job(**kw)``: (losses, final state), once per session."""
    key = tuple(sorted(kw.items()))
    if key not in _REFERENCES:
        out = tmp_path_factory.mktemp("invariant-reference")
        losses = train_losses(job(out, strategy="single", nproc=1, **kw))
        _REFERENCES[key] = (losses, consolidated_state(out))
    return _REFERENCES[key]


# -- the arithmetic ---------------------------------------------------------------------------------------
def test_quantize_is_round_of_the_exact_product_in_every_dtype_path():
    from distrain.parallel.invariant import quantize

    g = torch.randn(10_000) * 1e-3
    g[:8] = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 3e-38, -7.0, 0.0])
    for e in (0, 1, 30, 61, 119, 121, 200, -3):
        want = torch.round(g.double() * 2.0 ** e)
        ok = want.abs() < 2.0 ** 62
        assert torch.equal(quantize(g, e)[ok], want[ok].to(torch.int64)), e
    b = g.bfloat16()
    assert torch.equal(quantize(b, 50), torch.round(b.double() * 2.0 ** 50).to(torch.int64))


def test_an_exact_sum_has_the_same_bits_however_it_is_split_and_ordered():
    from distrain.parallel.invariant import exact_sum

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(50_000, generator=gen) * torch.exp2(torch.randint(-30, 10, (50_000,), generator=gen).float()))
    x = x.float().double().square()  # float32 values' squares: exact in float64, as the norm uses them
    whole = exact_sum([x], addends=x.numel())
    rng = random.Random(0)
    for parts in (2, 3, 5, 17):
        cuts = sorted(rng.sample(range(1, x.numel()), parts - 1))
        pieces = [p for p in torch.tensor_split(x[torch.randperm(x.numel(), generator=gen)], cuts)]
        rng.shuffle(pieces)
        assert exact_sum(pieces, addends=x.numel()) == whole  # bits, not closeness
    # and accurate: each addend rounds by at most half a step of the grid 2**-e, e = 62 - ceil(log2 n) - E
    # (E: the largest addend's magnitude); far closer than a float32 sum of the same values
    from distrain.parallel.invariant.fixed_point import limit_bits, magnitude

    e = limit_bits(x.numel()) - magnitude(float(x.max()))
    err = abs(whole - math.fsum(x.tolist()))
    assert err <= x.numel() * 2.0 ** -(e + 1)
    assert err < abs(float(x.float().sum()) - math.fsum(x.tolist())) / 1e3


class Linear1(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor([1.0, -2.0, 0.5]))

    def forward(self, x):
        return x @ self.w


def test_a_unit_past_the_headroom_reruns_the_step_with_the_exponents_of_its_maxima():
    """Unit 1's gradient is 2**12 times unit 0's (past the 2**8 headroom of exponents set from unit 0):
    the step runs again, once, and the gradient is the exact sum rounded once."""
    from distrain.parallel.invariant import FixedPointGradients, InvariantStep
    from distrain.parallel.zero.layout import make_unit

    m = Linear1()
    grads = FixedPointGradients([make_unit(0, list(m.named_parameters()), 1)], [[m.w]], addends=2)
    x = torch.tensor([[1.0, 0.25, -3.0], [4096.0, 1024.0, -12288.0]])
    y = torch.tensor([0.75, -1.0])
    step = InvariantStep(m, lambda out, t: ((out - t) ** 2).sum(), grads, units=2, replica_units=range(2), seed=0)
    loss = step(x, y, 0)
    assert step.redone == 1
    grads.gradients()
    per_unit = [2 * (x[k] @ m.w.detach() - y[k]).double() * x[k].double() for k in range(2)]
    exact = ((per_unit[0] + per_unit[1]) / 2).float()  # float64 is exact for these few terms
    assert torch.equal(m.w.grad, exact)
    want = math.fsum(float(((x[k] @ m.w.detach()) - y[k]) ** 2) for k in range(2)) / 2
    assert loss == want


# -- refusals, before any rank starts ---------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(cp=2, nproc=2), "--layout-invariant covers data, tensor and pipeline parallelism today, not --cp 2:"),
    (dict(strategy="torch-ddp", nproc=2), "--layout-invariant: --strategy torch-ddp is not covered"),
    (dict(accum_steps=2, nproc=2), "--layout-invariant already accumulates: each replica runs its units of 1 "
                                   "samples one at a time; drop --accum-steps 2"),
    (dict(units=5, nproc=2), "--layout-invariant: --units 5 must divide --batch-size 12; use one of 1, 2, 3, 4, 6, 12"),
    (dict(units=2, nproc=3), "--layout-invariant: 3 data-parallel replicas cannot share 2 units (each needs at "
                             "least one); use --units 3 or fewer ranks"),
    (dict(units=4, nproc=3, strategy="zero3"), "--layout-invariant with --strategy zero3: every replica must run "
                                               "the same number of units"),
    (dict(compression="bf16", nproc=2), "--layout-invariant sums gradients as integers; drop --compression bf16"),
    (dict(layout_invariant=False, units=4), "--units 4 only acts with --layout-invariant"),
    (dict(layout_invariant=False, units=0, invariant_tp=True), "--invariant-tp only acts with --layout-invariant"),
])
def test_what_it_cannot_do_is_refused_in_one_line(tmp_path, kw, message):
    from distrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        job(tmp_path / "run", **{"strategy": "ddp", **kw}).validate()
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


# -- the fast check: one process, 2 and 3 replicas ----------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [dict(strategy="ddp", nproc=2), dict(strategy="zero2", nproc=3)],
                         ids=["ddp2", "zero2-3"])
def test_data_parallel_equals_one_process_bit_for_bit(tmp_path, tmp_path_factory, layout):
    ref = reference(tmp_path_factory, steps=6)
    out = tmp_path / "run"
    assert_bitwise(out, train_losses(job(out, steps=6, **layout)), ref)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_without_the_flag_a_float32_layout_is_not_bitwise_one_process(tmp_path, tmp_path_factory):
    """What the flag is for: the default path at P = 3 rounds differently from one process."""
    single = train_losses(trainer_config(tmp_path / "a", dtype="float32", steps=4, strategy="single", nproc=1))
    three = train_losses(trainer_config(tmp_path / "b", dtype="float32", steps=4, strategy="ddp", nproc=3))
    assert single[0] == three[0] or abs(single[0] - three[0]) < 1e-5  # the same start, to rounding
    assert single != three


# -- the matrix ---------------------------------------------------------------------------------------------
MATRIX = {
    **{f"{s}-{p}": dict(strategy=s, nproc=p) for s in ("ddp", "zero1", "zero2", "zero3") for p in (2, 3, 4)},
    "ddp-2-checkpointing": dict(strategy="ddp", nproc=2, activation_checkpointing=True),
    "zero2-3-checkpointing": dict(strategy="zero2", nproc=3, activation_checkpointing=True),
    "single-checkpointing": dict(strategy="single", nproc=1, activation_checkpointing=True),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", invariant_matrix(MATRIX, ["ddp-3", "ddp-4", "zero1-2", "zero2-3", "zero3-4",
                                                            "zero2-3-checkpointing", "single-checkpointing"]))
def test_gpt_every_data_parallel_layout_is_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    out = tmp_path / "run"
    assert_bitwise(out, train_losses(job(out, **MATRIX[name])), reference(tmp_path_factory))


MODELS = {
    "llama-tiny-ddp-3": dict(model="llama-tiny", strategy="ddp", nproc=3),
    "llama-tiny-zero3-4": dict(model="llama-tiny", strategy="zero3", nproc=4),
    "llama-moe-tiny-ddp-3": dict(model="llama-moe-tiny", strategy="ddp", nproc=3),
    "llama-moe-tiny-zero1-2": dict(model="llama-moe-tiny", strategy="zero1", nproc=2),
}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", invariant_matrix(MODELS, ["llama-tiny-zero3-4", "llama-moe-tiny-ddp-3"]))
def test_llama_and_a_mixture_of_experts_are_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    kw = dict(MODELS[name])
    out = tmp_path / "run"
    assert_bitwise(out, train_losses(job(out, **kw)), reference(tmp_path_factory, model=kw["model"]))


BF16 = {"ddp-3": dict(strategy="ddp", nproc=3), "zero2-2": dict(strategy="zero2", nproc=2),
        "zero3-4": dict(strategy="zero3", nproc=4)}


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", invariant_matrix(BF16, ["zero2-2"]))
def test_bf16_autocast_is_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    out = tmp_path / "run"
    losses = train_losses(job(out, autocast="bf16", **BF16[name]))
    assert_bitwise(out, losses, reference(tmp_path_factory, autocast="bf16"))


class BlockSize:
    def __init__(self, block_size: int):
        self.block_size = block_size


class Dropped(nn.Module):
    """A model of the user's own with dropout: its random numbers must follow the unit, not the rank."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.config = BlockSize(16)  # what the trainer cuts the text into
        self.emb = nn.Embedding(256, 24)
        self.mix = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 256))

    def forward(self, x):
        return self.mix(self.emb(x))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_your_own_model_with_dropout_is_one_process_bit_for_bit(tmp_path):
    import distrain

    runs = {}
    for name, layout in {"single": dict(strategy="single", nproc=1), "ddp-3": dict(strategy="ddp", nproc=3),
                         "zero2-4": dict(strategy="zero2", nproc=4)}.items():
        out = tmp_path / name
        distrain.train(model=Dropped(), config=job(out, steps=12, **layout))
        from distrain.trainer.metrics import read_metrics

        runs[name] = ([r["loss"] for r in read_metrics(out / "metrics.jsonl")], consolidated_state(out), out)
    for name in ("ddp-3", "zero2-4"):
        assert_bitwise(runs[name][2], runs[name][0], runs["single"][:2])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_resumed_on_another_layout_is_the_run_that_never_stopped(tmp_path, tmp_path_factory):
    """8 steps of ddp at P = 2 with a checkpoint, then --resume --reshard at zero2 P = 3 to step 30 (and again
    from there at one process would be the same): the whole is one process's 30 steps, bit for bit."""
    from distrain.trainer.metrics import read_metrics

    out = tmp_path / "run"
    train_losses(job(out, strategy="ddp", nproc=2, steps=8, ckpt_every=8))
    train_losses(job(out, strategy="zero2", nproc=3, resume=True, reshard=True))
    losses = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert_bitwise(out, losses, reference(tmp_path_factory))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_an_elastic_job_that_loses_a_rank_continues_bit_for_bit(tmp_path, tmp_path_factory, monkeypatch):
    """SIGKILL one of 4 ranks at step 5: the step is redone by 3 (units 4, 4, 4 instead of 3 each) and every
    loss, and the end, equal one process's. Then a replacement joins 3 -> 4: the same."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_events, read_metrics

    ref = reference(tmp_path_factory, steps=12)
    for name, faults, kw in (("loss", "1@5", dict(nproc=4, elastic="3:4")),
                             ("join", "0@5:hold", dict(nproc=3, elastic="3:4", elastic_replace=1))):
        monkeypatch.setenv("DISTRAIN_ELASTIC_FAULTS", faults)
        out = tmp_path / name
        summary = train(job(out, strategy="ddp", steps=12, collective_timeout=30, report=False, **kw))
        assert isinstance(summary, dict)
        (event,) = read_events(out / "metrics.jsonl")
        assert event["event"] == "membership"
        assert_bitwise(out, [r["loss"] for r in read_metrics(out / "metrics.jsonl")], ref)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_hugging_face_llama_from_init_from_is_one_process_bit_for_bit(tmp_path):
    """--init-from a transformers LlamaForCausalLM folder (float32): one process, ddp P = 3 and zero2 P = 2
    give the same bits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(5)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager"))
    hf.save_pretrained(tmp_path / "hf")
    runs = {}
    for name, layout in {"single": dict(strategy="single", nproc=1), "ddp-3": dict(strategy="ddp", nproc=3),
                         "zero2-2": dict(strategy="zero2", nproc=2)}.items():
        out = tmp_path / name
        losses = train_losses(job(out, model=None, init_from=str(tmp_path / "hf"), steps=10, **layout))
        runs[name] = (losses, consolidated_state(out), out)
    for name in ("ddp-3", "zero2-2"):
        assert_bitwise(runs[name][2], runs[name][0], runs["single"][:2])
