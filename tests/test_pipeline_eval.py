"""Evaluation under pipeline parallelism: the forward-only schedule (forward_only) equals a plain
forward of the whole model on every stage kind and schedule and leaves training state alone,
and the trainer's validation loss (and accuracy) on dp x tp x pp layouts and with ZeRO equals
the single process's, without changing any training loss."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import distrain
from distrain import comm
from distrain.errors import ConfigError, RankFailedError
from distrain.models import GPT, GPTConfig, build_model, lm_loss
from distrain.parallel.pipeline_parallel import (
    InterleavedStage, PipelineStage, evaluation_mode, forward_only, interleaved_step, pipeline_step,
)
from distrain.trainer.metrics import read_metrics

from conftest import expect_error, run_ranks, trainer_config

B, T, V = 6, 16, 256  # eval batch (6, 16) of token ids


class NoiseProbe(nn.Module):
    """Returns its input unchanged (x + 0 * noise) but draws from the global generator on every
    call, in any mode: evaluation must leave the generator as it found it all the same."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 0.0 * torch.rand_like(x)


def _layers() -> list[nn.Module]:
    """gpt-tiny with dropout 0.1 (eval mode must switch it off) and a NoiseProbe after block 0:
    [Embedding, Block, NoiseProbe, Block x 3, Head], fp64, the same on every rank."""
    torch.manual_seed(0)
    model = build_model("gpt-tiny", dropout=0.1).double()
    return [model.layers[0], model.layers[1], NoiseProbe(), *model.layers[2:]]


def _batch(seed: int, n: int = B):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (n, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]  # ids (n, 16), targets (n, 16)


def _score(out, y):  # [loss, logits...]: the loss and every logit of the micro-batch
    return torch.cat([lm_loss(out, y).view(1), out.flatten()])


def _state(stage: nn.Module) -> dict:
    """What forward_only must leave as it was."""
    return {"rng": torch.get_rng_state(), "modes": [m.training for m in stage.modules()],
            "grads": [None if q.grad is None else q.grad.clone() for q in stage.parameters()],
            "params": [q.detach().clone() for q in stage.parameters()],
            "timeline": stage.timeline, "events": list(stage.timeline.events) if stage.timeline else None}


def _compare_state(before: dict, stage: nn.Module, what: str) -> list[str]:
    bad, after = [], _state(stage)
    if not torch.equal(before["rng"], after["rng"]):
        bad.append(f"{what}: the global random generator moved")
    if before["modes"] != after["modes"]:
        bad.append(f"{what}: module modes {after['modes']} != {before['modes']}")
    for i, (g0, g1) in enumerate(zip(before["grads"], after["grads"])):
        if (g0 is None) != (g1 is None) or (g0 is not None and not torch.equal(g0, g1)):
            bad.append(f"{what}: parameter {i}'s .grad changed")
    if not all(torch.equal(a, b) for a, b in zip(before["params"], after["params"])):
        bad.append(f"{what}: a parameter changed")
    if after["timeline"] is not before["timeline"] or (before["events"] is not None
                                                       and list(after["timeline"].events) != before["events"]):
        bad.append(f"{what}: stage.timeline was replaced or changed")
    return bad


def _check_scores(scores, whole: nn.Module, xs, ys, what: str) -> list[str]:
    """The last stage's scores against the whole model's forward of the same micro-batches."""
    with torch.no_grad():
        whole.eval()
        want = [_score(whole(x), y) for x, y in zip(xs, ys)]
        full = lm_loss(whole(torch.cat(xs)), torch.cat(ys)).item()  # one forward of the whole batch
    bad = []
    if len(scores) != len(want):
        return [f"{what}: {len(scores)} scores for {len(want)} micro-batches"]
    for k, (got, ref) in enumerate(zip(scores, want)):
        if got.requires_grad or got.grad_fn is not None:
            bad.append(f"{what}: micro-batch {k}'s score is part of an autograd graph")
        if not torch.allclose(got, ref, rtol=1e-12, atol=1e-12):
            bad.append(f"{what}: micro-batch {k} differs by {(got - ref).abs().max().item():.3g}")
    mean = sum(s[0].item() for s in scores) / len(scores)  # equal micro-batches: the batch's mean loss
    if abs(mean - full) > 1e-12 * abs(full):
        bad.append(f"{what}: mean micro-batch loss {mean!r} != the whole batch's {full!r}")
    return bad


def _forward_only_rank(rank: int, p: int) -> list[str]:
    bad: list[str] = []
    ranks = list(range(p))
    xs, ys = (t.split(B // 3) for t in _batch(1))  # 3 micro-batches of (2, 16), inputs and targets
    x2, y2 = _batch(2)
    # plain stages, after a training step of each schedule (gradients, a timeline: training state)
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        layers = _layers()
        whole = nn.Sequential(*layers)  # the same modules: no optimizer step, so the parameters stay equal
        stage = PipelineStage(layers, rank, p, rank - 1 if rank else None, rank + 1 if rank < p - 1 else None,
                              balance=[2, 3, 2] if p == 3 else [3, 4])
        stage.layers[0].eval()  # one module already in eval mode: each module's own flag must come back
        x, y = _batch(0)
        pipeline_step(stage, x if stage.is_first else None, y if stage.is_last else None,
                      lm_loss if stage.is_last else None, schedule=schedule, num_microbatches=2)
        before = _state(stage)
        probe = layers[2]
        calls = probe.calls
        # m = 3 micro-batches as lists, then the batch (6, 16) cut here into 6 (more than MAX_SENDS_IN_FLIGHT)
        with comm.ledger() as led:
            scores = forward_only(stage, xs if stage.is_first else None, ys if stage.is_last else None,
                                  _score if stage.is_last else None, num_microbatches=3)
        # traffic: per micro-batch one header (10 int64) and one (2, 16, 32) fp64 activation, forward only
        want = 3 * (80 + 2 * T * 32 * 8)
        got = led.get("pp-eval", "p2p")
        if (got.bytes_sent, got.bytes_recv) != (want * (not stage.is_last), want * (not stage.is_first)) \
                or led.total().bytes_sent != got.bytes_sent or led.total().bytes_recv != got.bytes_recv:
            bad.append(f"{schedule} stage {rank}: sent {got.bytes_sent}, received {got.bytes_recv} under pp-eval "
                       f"(of {led.total().bytes_sent}, {led.total().bytes_recv}), want {want} each way")
        scores6 = forward_only(stage, x2 if stage.is_first else None, y2 if stage.is_last else None,
                               _score if stage.is_last else None, num_microbatches=6)
        bad += _compare_state(before, stage, schedule)
        if probe in stage.layers and probe.calls != calls + 9:
            bad.append(f"{schedule}: the probe ran {probe.calls - calls} times, not 3 + 6")
        if stage.is_last:
            bad += _check_scores(scores, whole, list(xs), list(ys), f"{schedule}, m=3")
            bad += _check_scores(scores6, whole, list(x2.split(1)), list(y2.split(1)), f"{schedule}, m=6")
        elif scores is not None or scores6 is not None:
            bad.append(f"{schedule}: stage {rank} of {p} returned scores")
    # interleaved stages (v = 2: 2p chunks of the 7 layers), after an interleaved training step;
    # m = 3 and 4: a last group of micro-batches smaller than p, and (p = 2) a multiple of p
    layers = _layers()
    whole = nn.Sequential(*layers)
    stage = InterleavedStage(layers, rank, p, 2, ranks, balance=[1, 1, 2, 1, 1, 1] if p == 3 else [2, 2, 2, 1])
    x, y = _batch(0)
    interleaved_step(stage, x if rank == 0 else None, y if rank == p - 1 else None,
                     lm_loss if rank == p - 1 else None, num_microbatches=p)
    for m in (3, 4):
        xm, ym = _batch(10 + m, 2 * m)  # (2m, 16): m micro-batches of 2
        before = _state(stage)
        scores = forward_only(stage, xm if rank == 0 else None, ym if rank == p - 1 else None,
                              _score if rank == p - 1 else None, num_microbatches=m)
        bad += _compare_state(before, stage, f"interleaved m={m}")
        if rank == p - 1:
            bad += _check_scores(scores, whole, list(xm.split(2)), list(ym.split(2)), f"interleaved m={m}")
    # wrong arguments: one-line errors naming the fix
    stage = PipelineStage(_layers(), rank, p, rank - 1 if rank else None, rank + 1 if rank < p - 1 else None)
    if stage.is_first:
        bad.append(expect_error(lambda: forward_only(stage, None, num_microbatches=2), ConfigError,
                                f"stage 0 of {p} holds the first layers: pass micro_inputs"))
        bad.append(expect_error(lambda: forward_only(stage, _batch(0)[0], num_microbatches=4), ConfigError,
                                "batch 6 is not divisible into 4 micro-batches"))
    if stage.is_last:
        bad.append(expect_error(lambda: forward_only(stage, None, _batch(0)[1], num_microbatches=2), ConfigError,
                                "holds the last layers: pass micro_targets and loss_fn"))
    bad.append(expect_error(lambda: forward_only(nn.Linear(2, 2), num_microbatches=1), ConfigError,
                            "expected a PipelineStage or an InterleavedStage, got Linear"))
    return [b for b in bad if b]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("p", [2, 3])
def test_forward_only_equals_whole_model_and_leaves_training_state(p):
    run_ranks(_forward_only_rank, p, p, timeout=80)


def test_evaluation_mode_restores_modes_and_generator_after_an_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), NoiseProbe())
    model[1].eval()
    rng = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"):
        with evaluation_mode(model):
            assert not torch.is_grad_enabled() and not any(m.training for m in model.modules())
            model(torch.ones(3, 2))
            raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert torch.equal(torch.get_rng_state(), rng) and torch.is_grad_enabled()


def test_one_rank_stages_equal_the_whole_model():
    """p = 1: a plain stage holding every layer, and an interleaved one whose 3 chunks hand each
    other the activations in-process (no messages, no process group)."""
    for make in (lambda layers: PipelineStage(layers, 0, 1),
                 lambda layers: InterleavedStage(layers, 0, 1, 3, [0], balance=[3, 2, 2])):
        layers = _layers()
        whole, stage = nn.Sequential(*layers), make(layers)
        xs, ys = _batch(4)
        rng = torch.get_rng_state()
        scores = forward_only(stage, xs, ys, _score, num_microbatches=3)
        assert torch.equal(torch.get_rng_state(), rng) and all(m.training for m in stage.modules())
        assert _check_scores(scores, whole, list(xs.split(2)), list(ys.split(2)), type(stage).__name__) == []


def _play(programs, window: int | None) -> bool:
    """Whether ranks running ``programs`` all finish: program r lists ops (needs, sends), ``needs`` the
    message the op receives (None: none; a receive blocks and is posted when the op is reached),
    ``sends`` the message it sends (None: none). A send completes once its receiver has posted the
    receive (Gloo's rendezvous); with ``window`` an op first waits until fewer than ``window`` of its
    rank's sends are incomplete (forward_only's plain stages), without it sends never block."""
    pc, sent, posted = [0] * len(programs), set(), set()
    unfinished: list[list] = [[] for _ in programs]
    progress = True
    while progress:
        progress = False
        for r, prog in enumerate(programs):
            while pc[r] < len(prog):
                needs, sends = prog[pc[r]]
                if needs is not None:
                    posted.add(needs)
                    if needs not in sent:
                        break
                if sends is not None and window is not None:
                    unfinished[r] = [msg for msg in unfinished[r] if msg not in posted]
                    if len(unfinished[r]) >= window:
                        break
                if sends is not None:
                    sent.add(sends)
                    unfinished[r].append(sends)
                pc[r] += 1
                progress = True
    return all(pc[r] == len(prog) for r, prog in enumerate(programs))


def _interleaved_programs(p: int, v: int, m: int, order) -> list[list]:
    out = []
    for r in range(p):
        prog = []
        for c, k in order(p, v, m):
            j = c * p + r  # virtual stage: receives (j - 1, k), sends (j, k)
            prog.append(((j - 1, k) if j > 0 else None, (j, k) if j < p * v - 1 else None))
        out.append(prog)
    return out


def test_forward_only_orders_cannot_deadlock():
    from distrain.parallel.pipeline_parallel.forward_only import MAX_SENDS_IN_FLIGHT, _interleaved_order

    for p in range(1, 9):  # plain stages: micro-batches in order, at most MAX_SENDS_IN_FLIGHT sends pending
        for m in range(1, 17):
            progs = [[((s - 1, k) if s else None, (s, k) if s < p - 1 else None) for k in range(m)] for s in range(p)]
            assert _play(progs, MAX_SENDS_IN_FLIGHT), (p, m)
    for p in range(1, 7):  # interleaved: Megatron's order, each (chunk, micro-batch) once, sends never block
        for v in range(1, 4):
            for m in range(1, 13):
                order = _interleaved_order(p, v, m)
                assert sorted(order) == [(c, k) for c in range(v) for k in range(m)], (p, v, m)
                assert all([k for c2, k in order if c2 == c] == list(range(m)) for c in range(v))
                assert _play(_interleaved_programs(p, v, m, _interleaved_order), None), (p, v, m)
    # why interleaved sends are not bounded: chunk-major order with bounded sends deadlocks (rank 0 runs
    # chunk 0 ahead while rank 1 waits to hand it chunk 1's inputs); the simulator finds it
    chunk_major = lambda p, v, m: [(c, k) for c in range(v) for k in range(m)]  # noqa: E731
    assert not _play(_interleaved_programs(2, 2, 8, chunk_major), MAX_SENDS_IN_FLIGHT)
    assert _play(_interleaved_programs(2, 2, 8, chunk_major), None)


def _mismatched(rank: int):
    stage = PipelineStage(_layers(), rank, 2, 0 if rank else None, None if rank else 1)
    x, y = _batch(0)
    forward_only(stage, x if rank == 0 else None, y if rank else None, lm_loss if rank else None,
                 num_microbatches=3 if rank == 0 else 2)


@pytest.mark.timeout(60)
def test_debug_check_names_a_num_microbatches_mismatch():
    with pytest.raises(RankFailedError, match=r"forward_only: stage 1 was called with num_microbatches=2 but its "
                                              r"predecessor \(rank 0\) with num_microbatches=3"):
        distrain.spawn(_mismatched, 2, timeout=40, env={"DISTRAIN_DEBUG": "1"})


# ---- a Hugging Face decoder cut into stages ----------------------------------------------


def _hf_rank(rank: int) -> list[str]:
    transformers = pytest.importorskip("transformers")
    try:  # the Hugging Face adapters' folder (being renamed from models/hf)
        from distrain.models.hf_transformers import pipeline_layers
    except ImportError:
        from distrain.models.hf import pipeline_layers
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).double()
    stage = PipelineStage(pipeline_layers(hf), rank, 2, 0 if rank else None, None if rank else 1)
    x, y = _batch(3)
    scores = forward_only(stage, x if rank == 0 else None, y if rank else None, _score if rank else None,
                          num_microbatches=3)
    if rank == 0:
        return [] if scores is None else ["the first stage returned scores"]
    with torch.no_grad():
        hf.eval()
        want = [_score(hf(xk).logits, yk) for xk, yk in zip(x.split(2), y.split(2))]
    return [f"micro-batch {k} differs by {(g - w).abs().max().item():.3g}" for k, (g, w) in
            enumerate(zip(scores, want)) if not torch.allclose(g, w, rtol=1e-12, atol=1e-12)]


@pytest.mark.timeout(90)
def test_forward_only_hugging_face_llama_equals_its_forward():
    pytest.importorskip("transformers")
    run_ranks(_hf_rank, 2, timeout=80)


# ---- through the trainer ----------------------------------------------------------------

EVAL = dict(steps=4, eval_every=2, eval_batches=2, log_every=1)  # evaluations after steps 2 (mid-run) and 4 (end)
_SINGLE: dict = {}


def _rows(cfg, model: nn.Module | None = None) -> list[dict]:
    distrain.train(cfg, model=model)
    return read_metrics(os.path.join(cfg.out, "metrics.jsonl"))


def _mlp() -> nn.Module:
    """mlp-tiny (64 -> 64 -> 32 -> 10) as your own model: the trainer's --tp/--pp take the presets
    of language models only, a model of yours with ``.layers`` (and the MLP's tp plan) any."""
    torch.manual_seed(0)
    return build_model("mlp-tiny")


def _single(tmp_path_factory, **kw) -> list[dict]:
    """The single-process run of ``trainer_config(**EVAL, **kw)``'s job, once per session
    (``model="mlp-tiny"``: :func:`_mlp` passed as your model)."""
    key = tuple(sorted(kw.items()))
    if key not in _SINGLE:
        mlp = kw.get("model") == "mlp-tiny"
        cfg = trainer_config(tmp_path_factory.mktemp("single"), **EVAL, **{k: v for k, v in kw.items() if k != "model"
                                                                          or not mlp}, strategy="single", nproc=1)
        _SINGLE[key] = _rows(cfg, _mlp() if mlp else None)
    return _SINGLE[key]


def _assert_same_evaluations(got: list[dict], ref: list[dict], what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1, 2, 3]
    assert [r["step"] for r in got if "val_loss" in r] == [r["step"] for r in ref if "val_loss" in r] == [1, 3], what
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-10, abs=0), f"{what}: training loss at step {g['step']}"
        if "val_loss" in r:
            assert g["val_loss"] == pytest.approx(r["val_loss"], rel=1e-10, abs=0), f"{what}: val_loss at {g['step']}"
            assert ("val_accuracy" in g) == ("val_accuracy" in r), f"{what}: val_accuracy at {g['step']}"
            if "val_accuracy" in r:  # a share of counted samples: exact
                assert g["val_accuracy"] == r["val_accuracy"], f"{what}: val_accuracy at {g['step']}"


@pytest.mark.timeout(60)
def test_trainer_pp2_validation_equals_one_process(tmp_path, tmp_path_factory):
    ref = _single(tmp_path_factory)
    got = _rows(trainer_config(tmp_path / "pp2", **EVAL, pp=2, nproc=2, microbatches=2))
    _assert_same_evaluations(got, ref, "pp2")


class DropoutGPT(GPT):
    """gpt-tiny with dropout 0.1: training draws from each rank's generator, so an evaluation that
    ran in train mode, or drew random numbers, or left a module in eval mode, changes the losses."""

    def __init__(self):
        super().__init__(GPTConfig(vocab_size=V, block_size=16, n_layer=4, n_head=4, n_embd=32, dropout=0.1))


@pytest.mark.timeout(60)
def test_trainer_evaluation_changes_no_training_loss(tmp_path):
    runs = {}
    for name, every in (("with", 1), ("without", 0)):
        torch.manual_seed(0)
        cfg = trainer_config(tmp_path / name, **{**EVAL, "eval_every": every}, pp=2, nproc=2, microbatches=2)
        distrain.train(cfg, model=DropoutGPT())
        runs[name] = read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
    assert [r["step"] for r in runs["with"] if "val_loss" in r] == [0, 1, 2, 3]  # an evaluation after every step
    assert not any("val_loss" in r for r in runs["without"])
    assert [r["loss"] for r in runs["with"]] == [r["loss"] for r in runs["without"]]  # bit for bit


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_dp2_tp2_pp2_validation_equals_one_process(tmp_path, tmp_path_factory):
    ref = _single(tmp_path_factory)
    got = _rows(trainer_config(tmp_path / "dp2tp2pp2", **EVAL, dp=2, tp=2, pp=2, nproc=8, microbatches=3))
    _assert_same_evaluations(got, ref, "dp2 x tp2 x pp2")


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model, data, layout", [
    ("mlp-tiny", "digits", dict(tp=2, pp=2, nproc=4, microbatches=2)),                        # val_accuracy
    ("mlp-tiny", "digits", dict(dp=2, pp=2, nproc=4, microbatches=3, strategy="zero1")),
    ("gpt-tiny", "shakespeare", dict(dp=2, pp=2, nproc=4, microbatches=2, strategy="zero2", schedule="zb-h1")),
    ("gpt-tiny", "shakespeare", dict(dp=2, tp=2, nproc=4, strategy="zero3")),                 # gathers in forward
])
def test_trainer_layouts_and_zero_validation_equal_one_process(tmp_path, tmp_path_factory, model, data, layout):
    ref = _single(tmp_path_factory, model=model, data=data)
    assert ("val_accuracy" in ref[-1]) == (model == "mlp-tiny")
    mlp = model == "mlp-tiny"
    cfg = trainer_config(tmp_path / "run", **EVAL, **({} if mlp else {"model": model}), data=data, **layout)
    _assert_same_evaluations(_rows(cfg, _mlp() if mlp else None), ref, f"{model} {layout}")
