"""--layout-invariant with --pp: a pipeline's micro-batches are the units of work (docs/determinism.md).

Every run is float32 and compared with ``==`` and ``torch.equal`` against the one-process run of the same
job: every step's loss as written to metrics.jsonl, and the consolidated final state (parameters and every
optimizer state tensor). No tolerance: one bit of difference fails.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn

from conftest import assert_bitwise, consolidated_state, invariant_matrix, train_losses, trainer_config

# every step's loss == one process's and the final state torch.equal: a layout whose sums fell in another order
# differs from the first step on (the clip acts at every step); 10 steps, not 30, kept `make test`'s pipeline
# layouts to ~1 minute of this 2-core host
STEPS = 10


def job(out, **kw):
    """A float32 gpt-tiny job with --layout-invariant, 8 units of one sample, clipped (the norm is exact too)."""
    base = dict(dtype="float32", layout_invariant=True, units=8, batch_size=8, steps=STEPS, grad_clip=0.5,
                log_every=10)
    return trainer_config(out, **{**base, **kw})


_REFERENCES: dict = {}


def reference(tmp_path_factory, **kw):
    """The one-process run of ``job(**kw)``: (losses, final state), once per session."""
    key = tuple(sorted(kw.items()))
    if key not in _REFERENCES:
        out = tmp_path_factory.mktemp("invariant-pipeline-reference")
        losses = train_losses(job(out, strategy="single", nproc=1, **kw))
        _REFERENCES[key] = (losses, consolidated_state(out))
    return _REFERENCES[key]


# -- in one process: the pipeline's step against the units' step ----------------------------------------------
@pytest.fixture
def one_thread():
    """As the engines run --layout-invariant (and cheap on a loaded host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpt_tiny():
    from distrain.models.registry import build_model

    torch.manual_seed(0)
    return build_model("gpt-tiny")


def lm_loss(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def blown_up(logits, targets):
    """The LM loss, 2**20 times larger for a unit whose first target is 255: past the exponents' headroom."""
    scale = 2.0 ** 20 if int(targets[0, 0]) == 255 else 1.0
    return lm_loss(logits, targets) * scale


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("loss_fn", [lm_loss, blown_up], ids=["plain", "overflow"])
def test_a_one_stage_pipeline_step_is_the_units_step_bit_for_bit(one_thread, schedule, loss_fn):
    """One stage of one (no process group): the pipeline's schedule (GPipe runs micro-batch 0's backward
    last, so every other micro-batch's gradients wait for the calibration; ZB-H1 defers the linear layers'
    weight gradients to W) gives InvariantStep's loss and gradients; with a unit past the headroom both
    redo the step once."""
    from distrain.parallel.invariant import FixedPointGradients, InvariantPipelineStep, InvariantStep, \
        StageGradients
    from distrain.parallel.pipeline_parallel import PipelineStage
    from distrain.parallel.zero.layout import make_unit

    a = gpt_tiny()
    b = copy.deepcopy(a)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 255, (4, 16), generator=g), torch.randint(0, 255, (4, 16), generator=g)
    y[2, 0] = 255  # unit 2 of blown_up: 2**20 times the others' gradients
    units = [make_unit(0, list(a.named_parameters()), 1)]
    ga = FixedPointGradients(units, [list(a.parameters())], addends=4)
    want = InvariantStep(a, loss_fn, ga, units=4, replica_units=range(4), seed=5)(x, y, 3)
    ga.gradients()
    stage = PipelineStage(b, 0, 1)
    gb = StageGradients([make_unit(0, list(stage.named_parameters()), 1)], [list(stage.parameters())], addends=4)
    run = InvariantPipelineStep(stage, loss_fn, gb, units=4, replica_units=range(4), seed=5, schedule=schedule)
    got = run(x, y, 3)
    gb.gradients()
    assert got == want
    assert run.redone == (loss_fn is blown_up)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_gradients_that_wait_for_the_calibration_or_the_fallback_sum_to_the_same_bits():
    """StageGradients fed the units in reverse (unit 0 last, as GPipe's backwards), with a parameter that
    unit 0 leaves without gradient (its exponent is the fallback: a reference of 1.0), equals
    FixedPointGradients fed them in order."""
    from distrain.parallel.invariant import FixedPointGradients, StageGradients
    from distrain.parallel.zero.layout import make_unit

    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(5, generator=gen) * 3.0 ** k, torch.randn(3, generator=gen) * 2.0 ** -k) for k in range(6)]

    def params():
        return [nn.Parameter(torch.zeros(5)), nn.Parameter(torch.zeros(3))]

    def unit(ps, k):
        ga, gb = data[k]
        loss = (ps[0] * ga).sum() + ((ps[1] * gb).sum() if k else 0.0)  # unit 0: no gradient for ps[1]
        loss.backward()

    pa, pb = params(), params()
    a = FixedPointGradients([make_unit(0, [("a", pa[0]), ("b", pa[1])], 1)], [pa], addends=6)
    a.begin()
    for k in range(6):
        unit(pa, k)
        a.end_unit()
    assert a.finish()[0]  # (every conversion fitted)
    a.gradients()
    b = StageGradients([make_unit(0, [("a", pb[0]), ("b", pb[1])], 1)], [pb], addends=6)
    b.begin()
    for k in reversed(range(6)):
        unit(pb, k)
        b.take(k)
        assert pb[0].grad is None and pb[1].grad is None  # nothing is left to add floats into
        if k == 0:
            b.calibrate()
    assert b.finish()[0]
    b.gradients()
    assert b.exponents == a.exponents
    for p, q in zip(pa, pb):
        assert torch.equal(p.grad, q.grad)


# -- refusals, before any rank starts ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, message", [
    (dict(nproc=2, pp=2, microbatches=4), "--layout-invariant with --pp 2: each replica's micro-batches are its units "
                                          "of work, so --microbatches must be --units 8 / dp 1 = 8; use "
                                          "--microbatches 8"),
    (dict(nproc=4, pp=2, microbatches=8), "--layout-invariant with --pp 2: each replica's micro-batches are its units "
                                          "of work, so --microbatches must be --units 8 / dp 2 = 4; use "
                                          "--microbatches 4"),
    (dict(nproc=6, pp=2, units=4, batch_size=12, microbatches=1),
     "--layout-invariant with --pp 2: the micro-batches are the units of work, so 3 data-parallel replicas must "
     "divide --units 4; use --units 3"),
    (dict(nproc=4, pp=2, strategy="zero3", microbatches=4),
     "--layout-invariant with --pp: zero3 does not run with a pipeline; use zero1 or zero2"),
    (dict(nproc=4, tp=2, pp=2, microbatches=8, invariant_tp=True),
     "--layout-invariant with --tp 2 covers --strategy ddp without --pp"),
])
def test_a_pipeline_that_cannot_be_one_process_is_refused_in_one_line(tmp_path, kw, message):
    from distrain.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        job(tmp_path / "run", **{"strategy": "ddp", **kw}).validate()
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


# -- the matrix: 30 steps, every loss and the end ---------------------------------------------------------------
MATRIX = {
    "pp2-gpipe": dict(strategy="ddp", nproc=2, pp=2, microbatches=8, schedule="gpipe"),
    "pp2-1f1b": dict(strategy="ddp", nproc=2, pp=2, microbatches=8, schedule="1f1b"),
    "pp4-1f1b": dict(strategy="ddp", nproc=4, pp=4, microbatches=8, schedule="1f1b"),
    "pp2-interleaved": dict(strategy="ddp", nproc=2, pp=2, microbatches=8, schedule="interleaved", virtual_stages=2),
    "pp2-zb-h1": dict(strategy="ddp", nproc=2, pp=2, microbatches=8, schedule="zb-h1"),
    "dp2xpp2-ddp": dict(strategy="ddp", nproc=4, pp=2, microbatches=4, schedule="1f1b"),
    "dp2xpp2-zero1": dict(strategy="zero1", nproc=4, pp=2, microbatches=4, schedule="1f1b"),
    "dp2xpp2-zero2-zb-h1": dict(strategy="zero2", nproc=4, pp=2, microbatches=4, schedule="zb-h1"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", invariant_matrix(MATRIX, ["pp2-gpipe", "pp4-1f1b", "pp2-interleaved", "pp2-zb-h1",
                                                            "dp2xpp2-zero1"]))
def test_gpt_every_pipeline_layout_is_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    out = tmp_path / "run"
    assert_bitwise(out, train_losses(job(out, **MATRIX[name])), reference(tmp_path_factory), steps=STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_llama_through_a_pipeline_is_one_process_bit_for_bit(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    losses = train_losses(job(out, model="llama-tiny", strategy="ddp", nproc=2, pp=2, microbatches=8))
    assert_bitwise(out, losses, reference(tmp_path_factory, model="llama-tiny"), steps=STEPS)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bf16_autocast_and_checkpointing_through_a_pipeline_are_one_process_bit_for_bit(tmp_path, tmp_path_factory):
    kw = dict(autocast="bf16", activation_checkpointing=True)
    out = tmp_path / "run"
    losses = train_losses(job(out, strategy="ddp", nproc=4, pp=2, microbatches=4, schedule="interleaved",
                              virtual_stages=2, **kw))
    assert_bitwise(out, losses, reference(tmp_path_factory, **kw), steps=STEPS)


class BlockSize:
    def __init__(self, block_size: int):
        self.block_size = block_size


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Dropout(0.2), nn.Linear(48, 24))

    def forward(self, x):
        return x + self.net(x)


class Dropped(nn.Module):
    """A model of the user's own, laid out for a pipeline (``layers``), with dropout in every stage: a unit
    must draw the numbers one process's forward draws, whichever stage runs which layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.config = BlockSize(16)  # what the trainer cuts the text into
        self.layers = nn.ModuleList([nn.Embedding(256, 24), Mix(), Mix(), Mix(), nn.Linear(24, 256)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_your_own_model_with_dropout_through_a_pipeline_is_one_process_bit_for_bit(tmp_path):
    import distrain
    from distrain.trainer.metrics import read_metrics

    runs = {}
    for name, layout in {"single": dict(strategy="single", nproc=1),
                         "pp2": dict(strategy="ddp", nproc=2, pp=2, microbatches=8),
                         "dp2xpp2-zb-h1": dict(strategy="zero1", nproc=4, pp=2, microbatches=4,
                                               schedule="zb-h1")}.items():
        out = tmp_path / name
        distrain.train(model=Dropped(), config=job(out, steps=STEPS, **layout))
        runs[name] = ([r["loss"] for r in read_metrics(out / "metrics.jsonl")], consolidated_state(out), out)
    for name in ("pp2", "dp2xpp2-zb-h1"):
        assert_bitwise(runs[name][2], runs[name][0], runs["single"][:2], steps=STEPS)
