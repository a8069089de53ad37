"""Zero-bubble ZB-H1 (Qi et al. 2024): the B / W split gives autograd's gradients exactly, the op
lists are complete and within 1F1B's peak, the simulated bubble is (p-1)/(3m+p-1), and GPT and
MLP pipelines on real Gloo ranks equal one process in fp64 over several Adam steps."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import reference_losses, run_ranks, train_losses, trainer_config
from distrain import Topology
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.parallel.pipeline_parallel import (
    PipelineStage, WeightGradStore, defer_weight_grads, deferral, ideal_bubble, peak_in_flight, pipeline_step,
    schedule_ops, simulate, zb_h1_bubble, zb_h1_makespan, zb_h1_ops,
)

STEPS = 3


def _ops(text: str) -> list[tuple[str, int]]:
    return [(t[0], int(t[1:])) for t in text.split()]


# ---- the schedule (pure) --------------------------------------------------------------------


def test_orders_by_hand_p4_m8():
    """The paper's figure 3 (top), p = 4, m = 8: stage s warms up with p - s forwards, runs B W F,
    fills the first s cool-down gaps with forwards and the rest with the oldest W."""
    assert zb_h1_ops(4, 0, 8) == _ops("F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7")
    assert zb_h1_ops(4, 1, 8) == _ops("F0 F1 F2 B0 W0 F3 B1 W1 F4 B2 W2 F5 B3 W3 F6 B4 F7 B5 W4 B6 W5 B7 W6 W7")
    assert zb_h1_ops(4, 3, 8) == _ops("F0 B0 W0 F1 B1 W1 F2 B2 W2 F3 B3 W3 F4 B4 F5 B5 F6 B6 F7 B7 W4 W5 W6 W7")
    assert zb_h1_ops(3, 0, 2) == _ops("F0 F1 B0 W0 B1 W1")  # m < p: no steady state
    assert schedule_ops("zb-h1", 4, 2, 8) == zb_h1_ops(4, 2, 8)


def test_op_lists_complete_ordered_and_within_1f1b_memory():
    for p, m in itertools.product(range(1, 9), range(1, 17)):
        peaks = []
        for s in range(p):
            ops = zb_h1_ops(p, s, m)
            assert sorted(ops) == sorted((kind, k) for kind in "FBW" for k in range(m)), (p, s, m)
            for k in range(m):  # F before B before W, each once
                assert ops.index(("F", k)) < ops.index(("B", k)) < ops.index(("W", k)), (p, s, m, k)
            for kind in "FBW":  # each kind in micro-batch order
                assert [k for x, k in ops if x == kind] == list(range(m)), (p, s, m, kind)
            peaks.append(peak_in_flight(ops))
            assert peaks[-1] <= min(p, m), (p, s, m, peaks)
        # the pipeline's peak (stage 0) is 1F1B's; later stages trade up to p - s more for no bubble
        assert max(peaks) == max(peak_in_flight(schedule_ops("1f1b", p, s, m)) for s in range(p)) == min(p, m)


def test_simulated_bubble_is_the_formula():
    for p, m in itertools.product(range(1, 9), range(1, 17)):
        tl = simulate("zb-h1", p, m, f_cost=1.0, b_cost=2.0)  # F = B = W = 1; raises ScheduleDeadlock if stuck
        assert tl.makespan() == zb_h1_makespan(p, m), (p, m)
        assert tl.bubble_fraction() == pytest.approx(zb_h1_bubble(p, m), abs=1e-12), (p, m)
        assert tl.bubble_fraction() == pytest.approx(tl.expected_bubble(), abs=1e-12)
        assert ideal_bubble(p, m, "zb-h1") == zb_h1_bubble(p, m)
        assert max(tl.peak_held()) == min(p, m)
        if m >= p:  # Qi et al. sec. 3.1: (p-1)(T_F+T_B-T_W) idle per stage, a third of 1F1B's
            assert zb_h1_bubble(p, m) == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-15)
            idle_1f1b = p * simulate("1f1b", p, m).makespan() - 3 * m * p
            assert p * tl.makespan() - 3 * m * p == pytest.approx(idle_1f1b / 3, abs=1e-9)


def test_order_not_timing_decides_deadlock():
    """Uneven costs only stretch the timeline (Kahn network): every stage still completes."""
    for p, m in [(3, 5), (4, 2), (5, 9)]:
        tl = simulate("zb-h1", p, m, f_cost=1.0, b_cost=3.0, w_cost=0.25, comm_cost=0.5)
        assert tl.orders() == [zb_h1_ops(p, s, m) for s in range(p)]


# ---- the B / W split in one process --------------------------------------------------------------


def _split_grads(model, x, y, loss_fn):
    store = WeightGradStore()
    with defer_weight_grads(store, 7):
        assert deferral() == (store, 7)
        loss = loss_fn(model(x), y)
    assert deferral() is None
    loss.backward()  # B
    after_b = {n for n, p in model.named_parameters() if p.grad is not None}
    held = store.held_bytes()
    assert store.pending() == [7] and held > 0
    ran = store.flush(7)  # W
    assert store.pending() == [] and store.held_bytes() == 0
    return after_b, ran


@pytest.mark.parametrize("name", ["gpt-tiny", "mlp-tiny"])
def test_split_equals_autograd(name):
    torch.manual_seed(0)
    ref = build_model(name).double()
    torch.manual_seed(0)
    model = build_model(name).double()
    g = torch.Generator().manual_seed(1)
    if name == "gpt-tiny":
        ids = torch.randint(0, 256, (4, 17), generator=g)
        x, y, loss_fn = ids[:, :-1], ids[:, 1:], lm_loss
    else:
        x, y, loss_fn = torch.randn(6, 64, generator=g, dtype=torch.float64), torch.arange(6) % 10, F.cross_entropy
    loss_fn(ref(x), y).backward()
    after_b, ran = _split_grads(model, x, y, loss_fn)
    linear = {n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    deferred = {f"{n}.{w}" for n in linear for w in ("weight", "bias")
                if getattr(model.get_submodule(n), w) is not None}
    assert ran == len(linear)
    # B gave exactly the non-linear parameters (LayerNorm, embeddings) their gradients
    assert after_b == {n for n, _ in model.named_parameters()} - deferred
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_split_linear_keyword_arguments_and_accumulation():
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    x = torch.randn(2, 4, 3, dtype=torch.float64, requires_grad=True)
    F.linear(x, w, b).pow(2).sum().backward()
    want = (x.grad.clone(), 2 * w.grad.clone(), 2 * b.grad.clone())
    x.grad = None  # w.grad, b.grad stay: W adds the second pass's gradients to them
    store = WeightGradStore()
    with defer_weight_grads(store, 0):
        y = F.linear(x, weight=w, bias=b)
    y.pow(2).sum().backward()
    torch.testing.assert_close(x.grad, want[0], rtol=1e-14, atol=0)
    store.flush(0)
    torch.testing.assert_close(w.grad, want[1], rtol=1e-14, atol=0)
    torch.testing.assert_close(b.grad, want[2], rtol=1e-14, atol=0)


def test_split_under_saved_tensor_hooks():
    """Hooks that repack saved tensors (offloading, sequence parallelism's re-gather) unpack other
    objects than the parameters: W must still accumulate into the parameters' own .grad."""
    torch.manual_seed(0)
    ref = build_model("mlp-tiny").double()
    torch.manual_seed(0)
    model = build_model("mlp-tiny").double()
    x, y = torch.randn(5, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(3)), torch.arange(5)
    F.cross_entropy(ref(x), y).backward()
    store = WeightGradStore()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t):  # unpack: a copy
        with defer_weight_grads(store, 0):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
    store.flush(0)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_split_with_checkpointing_and_computed_weights():
    """A weight computed from parameters (weight norm) is left to autograd; a checkpointed region
    recomputes the split linears when B runs in the block too. Both give autograd's gradients."""
    from torch.nn.utils.parametrizations import weight_norm
    from torch.utils.checkpoint import checkpoint

    def build():
        torch.manual_seed(0)
        return nn.Sequential(weight_norm(nn.Linear(6, 5)), nn.Tanh(), nn.Linear(5, 4)).double()

    x = torch.randn(3, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    ref, model = build(), build()
    checkpoint(ref, x, use_reentrant=False).pow(2).sum().backward()
    store = WeightGradStore()
    with defer_weight_grads(store, 0):
        y = checkpoint(model, x, use_reentrant=False).pow(2).sum()
    after_f = {n for n, p in model.named_parameters() if p.grad is not None}
    with defer_weight_grads(store, 0):
        y.backward()
    assert after_f == set() and store.flush(0) == 1  # only the plain Linear (2.*) was deferred
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-15, msg=n)


def test_autocast_is_refused():
    store = WeightGradStore()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ConfigError, match=r"zero-bubble B/W split does not run under autocast"):
            with defer_weight_grads(store, 0):
                pass


def test_single_stage_zb_equals_full_batch():
    torch.manual_seed(0)
    ref = build_model("gpt-tiny").double()
    torch.manual_seed(0)
    stage = PipelineStage(build_model("gpt-tiny").double(), 0, 1)
    ids = torch.randint(0, 256, (6, 17), generator=torch.Generator().manual_seed(2))
    x, y = ids[:, :-1], ids[:, 1:]
    loss_ref = lm_loss(ref(x), y)
    loss_ref.backward()
    loss = pipeline_step(stage, x, y, lm_loss, schedule="zb-h1", num_microbatches=3)
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-12, atol=0)
    for p, q in zip(stage.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    assert stage.timeline.order() == _ops("F0 B0 W0 F1 B1 W1 F2 B2 W2") and stage.timeline.peak_held == 1


# ---- real ranks ----------------------------------------------------------------------------


def _data(name: str, step: int, batch: int):
    g = torch.Generator().manual_seed(900 + step)
    if name == "gpt-tiny":
        ids = torch.randint(0, 256, (batch, 17), generator=g)
        return ids[:, :-1], ids[:, 1:], lm_loss
    return torch.randn(batch, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (batch,), generator=g), \
        F.cross_entropy


def _zb_rank(rank: int, name: str, m: int, batch: int) -> list[str]:
    torch.manual_seed(0)
    ref = build_model(name).double()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_losses = []
    for s in range(STEPS):
        x, y, loss_fn = _data(name, s, batch)
        ref_opt.zero_grad()
        loss = loss_fn(ref(x), y)
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())

    topo = Topology.from_world(pp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    # the MLP's layers alternate Linear and ReLU: two a stage, so every stage holds a Linear
    stage = PipelineStage.from_topology(build_model(name).double(), topo,
                                        balance="params" if name == "gpt-tiny" else [2] * topo.pp)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    p, bad = topo.pp, []
    for s in range(STEPS):
        x, y, loss_fn = _data(name, s, batch)
        opt.zero_grad()
        loss = pipeline_step(stage, x if stage.is_first else None, y if stage.is_last else None,
                             loss_fn if stage.is_last else None, schedule="zb-h1", num_microbatches=m)
        opt.step()
        if stage.is_last and abs(loss.item() - ref_losses[s]) > 1e-10 * abs(ref_losses[s]):
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
        ops = zb_h1_ops(p, topo.pp_rank, m)
        if stage.timeline.order() != ops:
            bad.append(f"step {s}: order {stage.timeline.order()}")
        if stage.timeline.peak_held != peak_in_flight(ops):
            bad.append(f"step {s}: peak held {stage.timeline.peak_held} != {peak_in_flight(ops)}")
    ref_layers = torch.nn.ModuleList(list(ref.layers)[stage.start:stage.stop])
    for (n, q), r in zip(stage.layers.named_parameters(), ref_layers.parameters()):
        if not torch.allclose(q, r, rtol=1e-10, atol=1e-12):
            bad.append(f"{n}: param max diff {(q - r).abs().max().item():.3e} after {STEPS} steps")
    return [f"rank {rank} {name} p={p} m={m}: {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name,p,m,batch", [
    ("gpt-tiny", 2, 3, 6),   # m not a multiple of p
    ("gpt-tiny", 3, 4, 8),
    ("gpt-tiny", 3, 2, 4),   # m < p: no steady state
    ("mlp-tiny", 3, 5, 10),  # first stage: Flatten + Linear on float inputs
])
def test_zero_bubble_equals_one_process(name, p, m, batch):
    run_ranks(_zb_rank, p, name, m, batch, timeout=200)


# ---- the trainer: distrain train --schedule zb-h1 ----------------------------------------------


@pytest.mark.timeout(300)
def test_trainer_zb_h1_equals_single_process(tmp_path, tmp_path_factory):
    """pp=3, 4 micro-batches, clipping by the global norm (after the W passes): the single run's losses."""
    ref = reference_losses(tmp_path_factory, steps=4, grad_clip=0.05)
    trace = tmp_path / "trace.json"
    got = train_losses(trainer_config(tmp_path / "zb", nproc=3, pp=3, microbatches=4, schedule="zb-h1", steps=4,
                                      grad_clip=0.05, trace=str(trace)))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-10, atol=0)
    events = json.loads(trace.read_text())["traceEvents"]
    ops = sorted((e["pid"], e["name"]) for e in events if e.get("ph") == "X" and e["cat"] in ("F", "B", "W"))
    assert ops == sorted((s, f"{k}{i}") for s in range(3) for k in "FBW" for i in range(4))


@pytest.mark.parametrize("kw,match", [
    (dict(schedule="zb-h1", autocast="bf16", dtype="float32"), r"--schedule zb-h1 defers weight gradients outside "
                                                               r"autocast's casts"),
    (dict(schedule="zb-h2"), r"--schedule must be gpipe or 1f1b, interleaved \(--virtual-stages chunks per rank\) "
                             r"or zb-h1 \(zero bubble\); got 'zb-h2'"),
])
def test_trainer_refuses_bad_zb_config(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        trainer_config(tmp_path / "bad", nproc=2, pp=2, microbatches=2, **kw).validate()


@pytest.mark.timeout(120)
def test_bench_rows_for_zb_h1():
    from distrain.bench.pipeline.bubbles import format_bubble_table, measure_bubbles

    rows = measure_bubbles((3,), (3, 6), schedules=("1f1b", "zb-h1"), f_ms=2.0, b_ms=4.0, repeats=1,
                           workload="sleep", timeout=100)
    assert [(r["schedule"], r["m"]) for r in rows] == [("1f1b", 3), ("1f1b", 6), ("zb-h1", 3), ("zb-h1", 6)]
    zb = rows[2:]
    assert [r["expected"] for r in zb] == pytest.approx([2 / 11, 2 / 20], abs=1e-15)  # (p-1)/(3m+p-1)
    # F 2 ms, B = W = 2 ms: the ideal step is (3m + p - 1) ops of 2 ms
    assert [r["ideal_makespan_ms"] for r in zb] == pytest.approx([22.0, 40.0])
    assert [r["expected_over_ideal"] for r in zb] == pytest.approx([2 / 9, 2 / 18])
    assert [r["peak_held"] for r in zb] == [[3, 3, 3]] * 2 and rows[1]["peak_held"] == [3, 2, 1]
    assert all(0.0 <= r["bubble"] < 1.0 for r in rows)
    assert format_bubble_table(rows).count("zb-h1") == 2


def test_bench_refuses_an_unknown_schedule():
    import argparse

    from distrain.cli.bench import add_pipeline_arguments, run_pipeline

    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    with pytest.raises(ConfigError, match=r"--schedules: unknown value\(s\) 'zb-v'; choose from gpipe, 1f1b, zb-h1"):
        run_pipeline(parser.parse_args(["--schedules", "1f1b,zb-v"]))
