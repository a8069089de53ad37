"""Sequence parallelism (Megatron, Korthikanti et al. 2022) equals one process in fp64 (alone and
under parallelize with a pipeline), issues exactly the all-gathers, reduce-scatters and gradient
all-reduces of the formula, and holds fewer activation bytes per rank than plain TP."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distrain
from distrain import Topology, comm
from distrain.comm.algorithms.cost import traffic
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.models.gpt.plan import gpt_tp_plan
from distrain.parallel import parallelize
from distrain.parallel.tensor_parallel import (
    apply_tensor_parallel, sequence_parallel_bytes_per_block, split_to_sequence, tp_loss, tp_shard_info,
)

from conftest import run_ranks

B, T, STEPS = 4, 16, 3


def _batch(step: int):
    g = torch.Generator().manual_seed(2000 + step)
    ids = torch.randint(0, 256, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _full():
    torch.manual_seed(0)
    return build_model("gpt-tiny").double()


def _reference():
    m = _full()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out = []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        opt.step()
    return out, {n: p.detach().clone() for n, p in m.named_parameters()}


def _sp_alone(rank: int, alg: str) -> list[str]:
    steps, final = _reference()
    model = apply_tensor_parallel(_full(), None, alg, plan=gpt_tp_plan(sequence_parallel=True))
    info = tp_shard_info(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    bad = []
    for s, (ref_loss, ref_grads) in enumerate(steps):
        x, y = _batch(s)
        opt.zero_grad()
        loss = tp_loss(model(x), y, None, alg)
        loss.backward()
        if abs(loss.item() - ref_loss) > 1e-12:
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_loss!r}")
        for n, p in model.named_parameters():
            want = info[n].take(ref_grads[n])
            if not torch.allclose(p.grad, want, rtol=1e-10, atol=1e-13):
                bad.append(f"step {s} grad {n}: max diff {(p.grad - want).abs().max().item():.2e}")
        opt.step()
    for n, p in model.named_parameters():
        if not torch.allclose(p, info[n].take(final[n]), rtol=1e-9, atol=1e-12):
            bad.append(f"param {n} after {STEPS} steps differs")
    return [f"rank {rank} tp={dist.get_world_size()} {alg}: {b}" for b in bad]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P,alg", [(2, "ring"), (4, "tree")])
def test_sequence_parallel_equals_one_process(P, alg):
    run_ranks(_sp_alone, P, alg, timeout=150)


def _sp_composed(rank: int, schedule: str) -> list[str]:
    steps, final = _reference()
    topo = Topology.from_world(dp=1, tp=2, pp=2)
    pm = parallelize(_full(), topo, loss_fn=lm_loss, tp_plan=gpt_tp_plan(sequence_parallel=True), algorithm="ring",
                     microbatches=2, schedule=schedule)
    info, start = tp_shard_info(pm.module), pm.stage.start
    opt = torch.optim.Adam(pm.parameters(), lr=1e-2)
    bad = []

    def full_name(n: str) -> str:
        head, i, rest = n.split(".", 2)
        return f"{head}.{int(i) + start}.{rest}"

    for s, (ref_loss, ref_grads) in enumerate(steps):
        x, y = _batch(s)
        opt.zero_grad()
        loss = pm.train_step(x, y)
        if pm.has_loss and abs(loss.item() - ref_loss) > 1e-12:
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_loss!r}")
        for n, p in pm.module.named_parameters():
            want = info[n].take(ref_grads[full_name(n)])
            if not torch.allclose(p.grad, want, rtol=1e-10, atol=1e-13):
                bad.append(f"step {s} grad {n}: max diff {(p.grad - want).abs().max().item():.2e}")
        opt.step()
    for n, p in pm.module.named_parameters():
        if not torch.allclose(p, info[n].take(final[full_name(n)]), rtol=1e-9, atol=1e-12):
            bad.append(f"param {n} after {STEPS} steps differs")
    return [f"rank {rank} tp=2 pp=2 sequence parallel {schedule}: {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])  # zb-h1: the split linears re-gather the shards in B
def test_sequence_parallel_with_a_pipeline_equals_one_process(schedule):
    run_ranks(_sp_composed, 4, schedule, timeout=200)


def _counts(rank: int) -> dict:
    model = apply_tensor_parallel(_full(), None, "ring", plan=gpt_tp_plan(sequence_parallel=True))
    x, y = _batch(0)
    out = {}
    with comm.ledger() as fwd:
        loss = tp_loss(model(x), y, None, "ring")
    with comm.ledger() as bwd:
        loss.backward()
    try:
        split_to_sequence(torch.zeros(2, 5, 3), None, "ring")
        out["error"] = "no error"
    except ConfigError as e:
        out["error"] = str(e)
    for k, led in (("forward", fwd), ("backward", bwd)):
        out[k] = {op: (led.get(op, "ring").calls, led.get(op, "ring").payload_bytes, led.get(op, "ring").bytes_sent)
                  for op in ("all_gather", "reduce_scatter", "all_reduce")}
    return out


@pytest.mark.timeout(90)
def test_ledger_equals_the_sequence_parallel_formula():
    P, L, h, e = 2, 4, 32, 8
    per = sequence_parallel_bytes_per_block(B, T, h, P, e)
    shard, full, tok = B * T * h // P * e, B * T * h * e, B * T * e
    assert per == {"all_gather": 2 * shard, "reduce_scatter": 2 * full, "grad_all_reduce": 6 * h * e}
    for rank, r in enumerate(distrain.spawn(_counts, P, timeout=75)):
        ag = lambda n: traffic("all_gather", "ring", P, rank, n // e, e)[0]  # noqa: E731  per-rank n
        rs = lambda n: traffic("reduce_scatter", "ring", P, rank, n // P // e, e)[0]  # noqa: E731
        ar = lambda n: traffic("all_reduce", "ring", P, rank, n // e, e)[0]  # noqa: E731
        # forward: L blocks x (2 all-gathers + 2 reduce-scatters), the head's all-gather; the
        # embedding's g and the loss's 3 all-reduces as in plain TP
        assert r["forward"] == {"all_gather": (2 * L + 1, L * per["all_gather"] + shard, (2 * L + 1) * ag(shard)),
                                "reduce_scatter": (2 * L, L * per["reduce_scatter"], 2 * L * rs(full)),
                                "all_reduce": (4, full + 3 * tok, ar(full) + 3 * ar(tok))}
        # backward: the mirror image (the embedding split's all-gather, the head's reduce-scatter),
        # the re-gather of every saved gathered input (attention, fc, lm_head: 2L + 1), and the
        # gradients of the sequence-sharded parameters: 6 per block, ln_f's 2
        assert r["backward"] == {"all_gather": (2 * (2 * L + 1), 2 * (L * per["all_gather"] + shard),
                                                2 * (2 * L + 1) * ag(shard)),
                                 "reduce_scatter": (2 * L + 1, (2 * L + 1) * full, (2 * L + 1) * rs(full)),
                                 "all_reduce": (6 * L + 2, (6 * L + 2) * h * e, (6 * L + 2) * ar(h * e))}
        # forward: the same bytes on the wire per block as plain TP's 2 all-reduces (ring)
        assert 2 * ag(shard) + 2 * rs(full) == 2 * ar(full)
        assert r["error"] == ("sequence parallel: the sequence length 5 (dim 1 of (2, 5, 3)) is not divisible by "
                              "tp=2; use a length that is a multiple of 2")


def _saved_bytes(rank: int) -> dict:
    """Bytes autograd saves for backward in one Block's forward, per rank (unique storages)."""
    from distrain.bench.tp.blocks import saved_activation_bytes

    out = {}
    for name, plan in (("tp", gpt_tp_plan()), ("sp", gpt_tp_plan(sequence_parallel=True))):
        model = apply_tensor_parallel(_full(), None, "native", plan=plan)
        rows = T // dist.get_world_size() if name == "sp" else T
        out[name] = saved_activation_bytes(model.layers[1], torch.randn(B, rows, 32, dtype=torch.float64))
    out["one"] = saved_activation_bytes(_full().layers[1], torch.randn(B, T, 32, dtype=torch.float64))
    return out


@pytest.mark.timeout(90)
def test_sequence_parallel_shrinks_the_activations_per_rank():
    res = distrain.spawn(_saved_bytes, 2, timeout=75)
    for r in res:
        # plain TP keeps the LayerNorm/residual region whole on every rank (here 4 of the block's
        # 16.25 x b*s*h*8 bytes); SP shards it along the sequence and keeps only the shard of the
        # all-gathered inputs (re-gathered in backward): every activation is divided by P, as the
        # paper's sbh*34/t against sbh*(10 + 24/t)
        assert r["one"] == 266240 and r["tp"] == 166912
        assert r["sp"] * 2 == r["one"]
    assert res[0] == res[1]
