"""Pipeline parallelism: partition, schedules (pure), and GPipe / 1F1B on real Gloo ranks equal to
one process on the full batch (fp64, Adam), with their order, memory peaks, traffic and traces."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
import torch.nn as nn

import distrain
from distrain import comm
from distrain.errors import ConfigError, RankFailedError
from distrain.models import build_model, lm_loss
from distrain.bench.pipeline.bubbles import format_bubble_table, measure_bubbles
from distrain.parallel.pipeline_parallel import (
    PipelineStage, ScheduleDeadlock, collect_timeline, ideal_bubble, layer_costs, partition, peak_in_flight,
    pipeline_step, schedule_ops, simulate, split_microbatches,
)
from distrain.topology import Topology

from conftest import run_ranks

GPT_TINY_COSTS = [8704, 12704, 12704, 12704, 12704, 8256]  # Embedding, 4 Blocks, Head
GLOBAL_B, T, M, STEPS = 8, 16, 4, 3


def _costed(costs):
    """Layers with exactly the given parameter counts."""
    out = []
    for c in costs:
        mod = nn.Module()
        if c:
            mod.w = nn.Parameter(torch.zeros(c))
        out.append(mod)
    return out


def _gpt():
    torch.manual_seed(0)
    return build_model("gpt-tiny").double()


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 256, (GLOBAL_B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]  # ids (8, 16), targets (8, 16)


# ---- partition --------------------------------------------------------------------------


def test_layer_costs_gpt_tiny():
    assert layer_costs(build_model("gpt-tiny")) == GPT_TINY_COSTS
    assert sum(GPT_TINY_COSTS) == 67776


@pytest.mark.parametrize("k, bounds", [
    (1, [(0, 6)]),
    # 33888 is half; E+B+B = 34112 | B+B+H = 33664 is the best cut
    (2, [(0, 3), (3, 6)]),
    # E+B 21408 | B+B 25408 | B+H 20960: any other cut puts 3 layers or B+B+B... in a stage
    (3, [(0, 2), (2, 4), (4, 6)]),
    # E+B 21408 | B | B | B+H 20960: the only cut without a B+B stage
    (4, [(0, 2), (2, 3), (3, 4), (4, 6)]),
    (6, [(i, i + 1) for i in range(6)]),
])
def test_partition_by_params_gpt_tiny(k, bounds):
    assert partition(build_model("gpt-tiny"), k) == bounds


def _brute_force(costs, k):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):  # lexicographic order of counts
        b = [0, *cuts, n]
        counts = [b[i + 1] - b[i] for i in range(k)]
        worst = max(sum(costs[b[i]:b[i + 1]]) for i in range(k))
        if best is None or worst < best[0] or (worst == best[0] and counts < best[1]):
            best = (worst, counts)
    return best


def test_partition_by_params_is_optimal_and_deterministic():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        costs = [rng.choice([0, 1, 2, 3, 5, 8, 13, 100]) for _ in range(n)]
        k = rng.randint(1, n)
        bounds = partition(_costed(costs), k)
        counts = [b - a for a, b in bounds]
        worst = max(sum(costs[a:b]) for a, b in bounds)
        best_worst, best_counts = _brute_force(costs, k)
        assert worst == best_worst, (costs, k, bounds)
        assert counts == best_counts, (costs, k, bounds)  # ties: earlier stages get fewer layers


def test_partition_explicit():
    m = build_model("gpt-tiny")
    assert partition(m, 3, [1, 4, 1]) == [(0, 1), (1, 5), (5, 6)]
    assert partition(list(m.layers), 2, [5, 1]) == [(0, 5), (5, 6)]


@pytest.mark.parametrize("k, balance, match", [
    (8, "params", r"gpt-tiny has 6 layers but 8 stages were asked for; use at most 6 stages"),
    (3, [2, 2, 3], r"sums to 7 but gpt-tiny has 6 layers"),
    (3, [3, 0, 3], r"at least one layer"),
    (2, [2, 2, 2], r"has 3 entries but there are 2 stages"),
    (2, "flops", r"balance must be 'params' or a list"),
    (0, "params", r"num_stages must be a positive int"),
])
def test_partition_errors(k, balance, match):
    with pytest.raises(ConfigError, match=match):
        partition(build_model("gpt-tiny"), k, balance, name="gpt-tiny")


def test_split_microbatches():
    x = torch.arange(24).reshape(12, 2)
    parts = split_microbatches(x, 4)
    assert [p.shape for p in parts] == [torch.Size([3, 2])] * 4
    assert torch.equal(torch.cat(parts), x)
    with pytest.raises(ConfigError, match=r"batch 12 is not divisible into 5 micro-batches"):
        split_microbatches(x, 5)
    with pytest.raises(ConfigError, match=r"positive int"):
        split_microbatches(x, 0)


# ---- schedules and their simulation ------------------------------------------------------


def test_schedule_orders_by_hand():
    F, B = "F", "B"
    assert schedule_ops("gpipe", 2, 0, 4) == [(F, 0), (F, 1), (F, 2), (F, 3), (B, 3), (B, 2), (B, 1), (B, 0)]
    assert schedule_ops("1f1b", 3, 0, 4) == [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)]
    assert schedule_ops("1f1b", 3, 1, 4) == [(F, 0), (F, 1), (B, 0), (F, 2), (B, 1), (F, 3), (B, 2), (B, 3)]
    assert schedule_ops("1f1b", 3, 2, 4) == [(F, 0), (B, 0), (F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3)]
    assert schedule_ops("1f1b", 4, 0, 2) == [(F, 0), (F, 1), (B, 0), (B, 1)]  # m < p: warm-up capped at m
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule 'pipedream'"):
        schedule_ops("pipedream", 2, 0, 4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_complete_and_bounded(schedule):
    for p, m in itertools.product(range(1, 7), range(1, 9)):
        for s in range(p):
            ops = schedule_ops(schedule, p, s, m)
            assert sorted(ops) == sorted([("F", k) for k in range(m)] + [("B", k) for k in range(m)])
            assert all(ops.index(("F", k)) < ops.index(("B", k)) for k in range(m))
            assert peak_in_flight(ops) == (m if schedule == "gpipe" else min(p - s, m))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulation_never_deadlocks_and_has_the_ideal_bubble(schedule):
    for p, m in itertools.product(range(1, 9), range(1, 17)):
        tl = simulate(schedule, p, m, f_cost=1.0, b_cost=2.0)
        assert tl.bubble_fraction() == pytest.approx(ideal_bubble(p, m), abs=1e-12), (p, m)
        assert tl.makespan() == pytest.approx(3.0 * (m + p - 1))


def test_blocking_sends_deadlock_1f1b():
    """Why the executor never waits on a send during the step (Gloo's send is a rendezvous)."""
    with pytest.raises(ScheduleDeadlock, match=r"stage 0 blocked in send act of micro-batch 1 to stage 1; "
                                               r"stage 1 blocked in send grad of micro-batch 0 to stage 0"):
        simulate("1f1b", 2, 2, blocking_sends=True)
    simulate("gpipe", 4, 8, blocking_sends=True)  # GPipe alone would survive blocking sends


def test_timeline_outputs_from_simulation(tmp_path):
    tl = simulate("1f1b", 3, 4)
    trace = tl.to_chrome_trace(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == trace
    x = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("F", "B")]
    assert len(x) == 3 * 2 * 4 and {e["pid"] for e in x} == {0, 1, 2}
    tl.plot_gantt(tmp_path / "g.png")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- one process: a single-stage pipeline, argument errors --------------------------------


def test_single_stage_equals_full_batch():
    ref, model = _gpt(), _gpt()
    x, y = _data(0)
    loss_ref = lm_loss(ref(x), y)
    loss_ref.backward()
    stage = PipelineStage(model, 0, 1)
    loss = pipeline_step(stage, x, y, lm_loss, schedule="1f1b", num_microbatches=M)
    torch.testing.assert_close(loss, loss_ref.detach(), rtol=1e-10, atol=0)
    for p, q in zip(stage.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-14)
    assert stage.timeline.peak_held == 1 and stage.timeline.order() == schedule_ops("1f1b", 1, 0, M)


def test_bad_arguments():
    model = build_model("gpt-tiny")
    x = torch.zeros(12, T, dtype=torch.long)
    solo = PipelineStage(model, 0, 1)
    with pytest.raises(ConfigError, match=r"batch 12 is not divisible into 5 micro-batches"):
        pipeline_step(solo, x, x, lm_loss, num_microbatches=5)
    with pytest.raises(ConfigError, match=r"gpt-tiny has 6 layers but 8 stages were asked for"):
        PipelineStage(model, 0, 8, None, 1, name="gpt-tiny")
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule"):
        pipeline_step(solo, x, x, lm_loss, schedule="zb", num_microbatches=4)
    with pytest.raises(ConfigError, match=r"list of 3 micro-batches but num_microbatches=4"):
        pipeline_step(solo, [x] * 3, x, lm_loss, num_microbatches=4)
    with pytest.raises(ConfigError, match=r"needs next_rank"):
        PipelineStage(model, 0, 2)
    with pytest.raises(ConfigError, match=r"has no previous stage; pass prev_rank=None"):
        PipelineStage(model, 0, 2, 3, 1)
    second = PipelineStage(model, 1, 2, prev_rank=0)  # checked before any message is sent
    with pytest.raises(ConfigError, match=r"is not the first stage: pass micro_inputs=None"):
        pipeline_step(second, x, x, lm_loss, num_microbatches=4)
    with pytest.raises(ConfigError, match=r"is the last stage: pass micro_targets and loss_fn"):
        pipeline_step(second, None, x, None, num_microbatches=4)


# ---- real ranks ----------------------------------------------------------------------------


def _check_equivalence(rank: int, use_topology: bool, out_dir: str) -> list[str]:
    import torch.distributed as dist

    p = dist.get_world_size()
    bad: list[str] = []
    ref = _gpt()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    ref_losses, ref_grads0 = [], None
    for s in range(STEPS):  # the single-process reference, on every rank
        x, y = _data(s)
        ref_opt.zero_grad()
        loss = lm_loss(ref(x), y)
        loss.backward()
        if s == 0:
            ref_grads0 = [q.grad.clone() for q in ref.parameters()]
        ref_opt.step()
        ref_losses.append(loss.item())
    ref_params = [q.detach() for q in ref.parameters()]

    topo = Topology.from_world(pp=p) if use_topology else None
    peak_bytes = {}
    for schedule in ("gpipe", "1f1b"):
        model = _gpt()
        if use_topology:
            stage = PipelineStage.from_topology(model, topo)
        else:
            stage = PipelineStage(model, rank, p, rank - 1 if rank else None, rank + 1 if rank < p - 1 else None)
        mine = slice(sum(len(list(model.layers[i].parameters())) for i in range(stage.start)), None)
        opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
        for s in range(STEPS):
            x, y = _data(s)
            opt.zero_grad()
            with comm.ledger() as led:
                loss = pipeline_step(stage, x if stage.is_first else None, y if stage.is_last else None,
                                     lm_loss if stage.is_last else None, schedule=schedule, num_microbatches=M)
            opt.step()
            if stage.is_last and abs(loss.item() - ref_losses[s]) > 1e-10 * abs(ref_losses[s]):
                bad.append(f"{schedule} step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
            if s == 0:
                for (name, q), g in zip(stage.named_parameters(), ref_grads0[mine]):
                    if not torch.allclose(q.grad, g, rtol=1e-10, atol=1e-14):
                        bad.append(f"{schedule} stage {rank} {name}: grad max diff {(q.grad - g).abs().max():.3e}")
                # traffic: per micro-batch a header (10 int64) and a (2, 16, 32) fp64 tensor each way
                per_msg = 80 + (GLOBAL_B // M) * T * 32 * 8
                want = M * per_msg * ((not stage.is_last) + (not stage.is_first))
                got = led.get("pp", "p2p")
                if (got.bytes_sent, got.bytes_recv) != (want, want):
                    bad.append(f"{schedule} stage {rank}: pp bytes {got.bytes_sent}/{got.bytes_recv} != {want}")
            tl = stage.timeline
            if tl.order() != schedule_ops(schedule, p, rank, M):
                bad.append(f"{schedule} stage {rank}: order {tl.order()}")
            want_held = M if schedule == "gpipe" else min(p - rank, M)
            if tl.peak_held != want_held:
                bad.append(f"{schedule} stage {rank}: peak held {tl.peak_held} != {want_held}")
            peak_bytes[schedule] = tl.peak_saved_bytes
        for (name, q), r in zip(stage.named_parameters(), ref_params[mine]):
            if not torch.allclose(q, r, rtol=1e-10, atol=1e-12):
                bad.append(f"{schedule} stage {rank} {name}: param max diff {(q - r).abs().max():.3e} "
                           f"after {STEPS} steps")

    # every micro-batch keeps the same bytes (its input and output), so the peaks scale with the counts
    if peak_bytes["1f1b"] * M != peak_bytes["gpipe"] * min(p - rank, M):
        bad.append(f"stage {rank}: peak saved bytes {peak_bytes}")

    if p == 2:  # the traces of a real run, m = 1 and m = 4
        for schedule, m in itertools.product(("gpipe", "1f1b"), (1, 4)):
            model = _gpt()
            stage = PipelineStage(model, rank, p, 0 if rank else None, None if rank else 1)
            x, y = _data(0)
            pipeline_step(stage, x if rank == 0 else None, y if rank == 1 else None,
                          lm_loss if rank == 1 else None, schedule=schedule, num_microbatches=m)
            tl = collect_timeline(stage.timeline, dst=0)
            if rank == 0:
                if tl.orders() != [schedule_ops(schedule, p, s, m) for s in range(p)]:
                    bad.append(f"{schedule} m={m}: orders {tl.orders()}")
                if not 0.0 <= tl.bubble_fraction() < 1.0:
                    bad.append(f"{schedule} m={m}: bubble {tl.bubble_fraction()}")
                tl.to_chrome_trace(f"{out_dir}/{schedule}_m{m}.json")
                tl.plot_gantt(f"{out_dir}/{schedule}_m{m}.png")
            elif tl is not None:
                bad.append("collect_timeline(dst=0) returned a timeline on rank 1")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("p, use_topology", [(2, False), (3, True), (4, True)])
def test_pipeline_equals_single_process(p, use_topology, tmp_path):
    run_ranks(_check_equivalence, p, use_topology, str(tmp_path), timeout=100)
    if p == 2:
        for schedule, m in itertools.product(("gpipe", "1f1b"), (1, 4)):
            trace = json.loads((tmp_path / f"{schedule}_m{m}.json").read_text())
            x = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("F", "B")]
            assert sorted((e["pid"], e["name"]) for e in x) == sorted(
                (s, f"{k}{i}") for s in range(2) for k in "FB" for i in range(m))
            assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in x)
            names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
            assert names == {"stage 0 (rank 0)", "stage 1 (rank 1)"}
            png = (tmp_path / f"{schedule}_m{m}.png").read_bytes()
            assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000


def _dp_times_pp(rank: int) -> list[str]:
    """dp=2 x pp=2: each dp replica pipelines half the batch, then grads are averaged over dp."""
    topo = Topology.from_world(dp=2, pp=2)
    ref, model = _gpt(), _gpt()
    x, y = _data(0)
    lm_loss(ref(x), y).backward()
    stage = PipelineStage.from_topology(model, topo)
    half = slice(topo.dp_rank * GLOBAL_B // 2, (topo.dp_rank + 1) * GLOBAL_B // 2)
    pipeline_step(stage, x[half] if stage.is_first else None, y[half] if stage.is_last else None,
                  lm_loss if stage.is_last else None, schedule="1f1b", num_microbatches=2)
    for q in stage.parameters():
        comm.all_reduce(q.grad, op="avg", group=topo.dp_group, algorithm="ring")
    ref_layers = nn.ModuleList(list(ref.layers)[stage.start:stage.stop])
    return [f"rank {rank} {n}" for (n, q), r in zip(stage.named_parameters(), ref_layers.parameters())
            if not torch.allclose(q.grad, r.grad, rtol=1e-10, atol=1e-14)]


@pytest.mark.timeout(90)
def test_composes_with_data_parallel():
    run_ranks(_dp_times_pp, 4, timeout=80)


def _mismatched_m(rank: int):
    model = _gpt()
    stage = PipelineStage(model, rank, 2, 0 if rank else None, None if rank else 1)
    x, y = _data(0)
    pipeline_step(stage, x if rank == 0 else None, y if rank else None, lm_loss if rank else None,
                  num_microbatches=4 if rank == 0 else 2)


@pytest.mark.timeout(60)
def test_debug_check_names_the_mismatch():
    with pytest.raises(RankFailedError, match=r"called with num_microbatches=2, schedule='1f1b' but stage 0 "
                                              r"\(rank 0\) with num_microbatches=4"):
        distrain.spawn(_mismatched_m, 2, timeout=40, env={"DISTRAIN_DEBUG": "1"})


@pytest.mark.timeout(90)
def test_measure_bubbles_smoke():
    rows = measure_bubbles((2,), (1, 2), f_ms=2.0, b_ms=4.0, repeats=1, workload="sleep", timeout=80)
    assert [(r["p"], r["m"], r["schedule"]) for r in rows] == [
        (2, 1, "gpipe"), (2, 2, "gpipe"), (2, 1, "1f1b"), (2, 2, "1f1b")]
    assert [r["peak_held"] for r in rows] == [[1, 1], [2, 2], [1, 1], [2, 1]]
    for r in rows:
        assert r["expected"] == ideal_bubble(2, r["m"]) and 0.0 <= r["bubble"] < 1.0
    # stage 1 holds 2 micro-batches under GPipe, 1 under 1F1B: input (16, 256) fp32 + the scalar loss
    assert rows[1]["peak_saved_bytes"][1] == 2 * rows[3]["peak_saved_bytes"][1] == 2 * (16 * 256 * 4 + 4)
    assert format_bubble_table(rows).count("\n") == 5
