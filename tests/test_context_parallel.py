"""Context parallelism (distrain.parallel.context_parallel): the online-softmax merge and the ring's
blocks against F.scaled_dot_product_attention in one process; ring and all-to-all attention on
2 and 3 ranks against one process (output and gradients, fp64) with the ledger's bytes equal to
the formulas; the causal load-balanced layout; the Topology's cp axis; and every bad input
refused in one line before anything starts.

The trainer's equivalence runs (cp2 ring / all-to-all, x dp2, x tp2, x pp2, zero2; GPT and Llama)
are in tests/test_context_parallel_train.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import distrain
from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.context_parallel import (
    ContextParallel, block_attention, check_length, join, merge, positions, ring_bytes, split, ulysses_bytes,
)
from distrain.parallel.context_parallel.ring import backward_step, expand_kv, forward_step, step_rows_cols
from distrain.topology import Topology

from conftest import run_ranks


def _qkv(B, h, g, T, d, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, n, T, d, generator=gen, dtype=dtype) for n in (h, g, g)]


def _reference(q, k, v, causal):
    """F.scaled_dot_product_attention's output and gradients for a fixed random dout."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), is_causal=causal)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=out.dtype)
    out.backward(dout)
    return out.detach(), dout, q.grad, k.grad, v.grad


# ---------------------------------------------------------------------------------------
# One process: the merge, the ring's blocks, the layout
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
def test_online_softmax_merge_equals_attention_over_all_keys(causal):
    q, k, v = _qkv(2, 3, 3, 10, 8, seed=1)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    s = 1 / math.sqrt(8)
    if causal:  # keys 0..4 and 5..9: queries 0..4 see part of the first block, none of the second
        o1, l1 = block_attention(q[:, :, :5], k[:, :, :5], v[:, :, :5], s, causal=True)
        o2, l2 = block_attention(q[:, :, 5:], k[:, :, :5], v[:, :, :5], s)
        o3, l3 = block_attention(q[:, :, 5:], k[:, :, 5:], v[:, :, 5:], s, causal=True)
        got = torch.cat([o1, merge(o2, l2, o3, l3)[0]], dim=2)
    else:  # any split of the keys, in any order of merging
        parts = [block_attention(q, k[:, :, a:b], v[:, :, a:b], s) for a, b in ((7, 10), (0, 3), (3, 7))]
        o, lse = parts[0]
        for o_b, l_b in parts[1:]:
            o, lse = merge(o, lse, o_b, l_b)
        got = o
        assert torch.allclose(lse, torch.logsumexp(q @ k.transpose(-2, -1) * s, dim=-1), rtol=1e-13, atol=0)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kernel", ["fused", "tiles", "tiles of 37"])  # torch's fused CPU kernel, or our tiles
@pytest.mark.parametrize("N,causal,g", [(1, True, 4), (2, True, 4), (3, True, 2), (4, True, 1), (3, False, 2)])
def test_ring_blocks_equal_attention_and_its_gradients(N, causal, g, kernel, monkeypatch):
    """Every rank's ring steps, run in one process on the load-balanced layout, give F.sdpa's output
    and gradients (q, and k/v summed over the ranks that used them), grouped-query heads too; with
    torch's fused kernel per block and with the plain tiles (37 scores per tile: several per block)."""
    from distrain.parallel.context_parallel import ring

    monkeypatch.setattr(ring, "FUSED", kernel == "fused")
    if kernel == "tiles of 37":
        monkeypatch.setattr(ring, "TILE", 37)
    B, h, T, d = 2, 4, 8 * N, 6
    q, k, v = _qkv(B, h, g, T, d, seed=N)
    out, dout, gq, gk, gv = _reference(q, k, v, causal)
    qs, ks, vs, dos = ([split(t, N, r, 2) for r in range(N)] for t in (q, k, v, dout))
    scale = 1 / math.sqrt(d)
    outs, dq = [], [torch.zeros_like(x) for x in qs]
    dk, dv = [torch.zeros_like(x) for x in ks], [torch.zeros_like(x) for x in vs]
    for r in range(N):
        o = lse = None
        for s in range(N):
            j = (r - s) % N
            o, lse = forward_step(o, lse, qs[r], ks[j], vs[j], s, r, N, causal, scale)
        outs.append(o)
        for s in range(N):
            j = (r - s) % N
            a, b = backward_step(dq[r], qs[r], ks[j], vs[j], dos[r], o, lse, s, r, N, causal, scale)
            dk[j] += a
            dv[j] += b
    for name, got, want in (("out", outs, out), ("dq", dq, gq), ("dk", dk, gk), ("dv", dv, gv)):
        assert torch.allclose(join(got, 2), want, rtol=1e-11, atol=1e-13), name


def test_load_balanced_layout_and_equal_work():
    assert positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    x = torch.arange(2 * 24 * 3).view(2, 24, 3)
    for N in (1, 2, 3, 4, 6):
        parts = [split(x, N, r, 1) for r in range(N)]
        assert all(p.shape == (2, 24 // N, 3) for p in parts)
        assert torch.equal(join(parts, 1), x)
        # causal work per rank: the (query, key) pairs its ring steps compute, equal on every rank
        L = 24 // N
        work = []
        for r in range(N):
            pairs = 0
            for s in range(N):
                rows, cols, diag = step_rows_cols(s, r, N, L)
                nq, nk = len(range(L)[rows]), len(range(L)[cols])
                pairs += nq * (nq + 1) // 2 if diag else nq * nk
            work.append(pairs)
        assert len(set(work)) == 1, work
        # and the pairs a rank's queries may see under the causal mask are the same number too
        seen = [int((positions(24, N, r) + 1).sum()) for r in range(N)]
        assert len(set(seen)) == 1, seen


def test_odd_lengths_are_refused_with_the_rule():
    with pytest.raises(ConfigError) as e:
        check_length(18, 2)
    assert str(e.value) == ("context parallelism (cp=2) cuts the sequence into 2 x cp = 4 equal chunks (causal load "
                            "balancing gives rank i the chunks i and 3-i), but 18 tokens do not divide by 4: choose "
                            "cp among 1, 3, 9, or a length that is a multiple of 4")
    with pytest.raises(ConfigError, match="15 tokens do not divide by 6"):
        split(torch.zeros(1, 15), 3, 0)
    check_length(15, 1)  # one rank: anything goes


def test_topology_cp_axis():
    t = Topology(dp=2, cp=2, rank=3)
    assert (t.dp_rank, t.cp_rank, t.tp_rank) == (1, 1, 0)
    assert t.groups_of("cp") == [[0, 1], [2, 3]] and t.groups_of("dp") == [[0, 2], [1, 3]]
    assert t.groups_of("dp_cp") == [[0, 1, 2, 3]] and t.dp_cp_ranks == [0, 1, 2, 3]
    t = Topology(dp=2, tp=2, pp=2, cp=2, rank=13)   # rank = pp*8 + dp*4 + cp*2 + tp
    assert tuple(t.coords) == (1, 1, 1, 0) and t.rank_of(pp=1, dp=1, cp=0, tp=1) == 13
    assert t.cp_ranks == [13, 15] and t.dp_cp_ranks == [9, 11, 13, 15] and t.pp_ranks == [5, 13]
    assert "dp=2 cp=2 tp=2 pp=2" in t.describe() and "this rank 13: pp=1 dp=1 cp=0 tp=1" in t.describe()
    assert Topology(2, 2, 2).describe() == Topology(2, 2, 2, 1).describe()  # cp=1: the grid it was
    with pytest.raises(ConfigError, match=r"dp\*cp\*tp\*pp = 2\*2\*1\*1 = 4 does not equal the world size 6"):
        Topology(dp=2, cp=2, world_size=6)


# ---------------------------------------------------------------------------------------
# Ranks: ring and all-to-all against one process, the ledger against the formulas
# ---------------------------------------------------------------------------------------

def _attention_rank(rank: int, variant: str, h: int, g: int, causal: bool) -> list[str]:
    N = dist.get_world_size()
    B, T, d, e = 2, 8 * N, 4, 8
    q, k, v = _qkv(B, h, g, T, d, seed=7)
    out, dout, gq, gk, gv = _reference(q, k, v, causal)
    cp = ContextParallel(None, variant)
    mine = [split(t, N, rank, 2).requires_grad_() for t in (q, k, v)]
    with comm.ledger() as fwd:
        y = cp.attend(*mine, causal=causal)
    with comm.ledger() as bwd:
        y.backward(split(dout, N, rank, 2))
    bad = []
    for name, got, want in (("out", y, out), ("dq", mine[0].grad, gq), ("dk", mine[1].grad, gk),
                            ("dv", mine[2].grad, gv)):
        if not torch.allclose(got, split(want, N, rank, 2), rtol=1e-11, atol=1e-13):
            bad.append(f"{name} differs by {(got - split(want, N, rank, 2)).abs().max().item():.2e}")
    label = "cp-ring" if variant == "ring" else "cp-all-to-all"
    L = T // N
    want = ring_bytes(B, g, L, d, N, e) if variant == "ring" else ulysses_bytes(B, h, g, L, d, N, e)
    for phase, led in (("forward", fwd), ("backward", bwd)):
        c = led.get(label, "p2p")
        got = (c.bytes_sent, c.bytes_recv, c.msgs_sent, c.msgs_recv, led.total().calls - c.calls)
        if got != (want[phase], want[phase], want[f"{phase}_msgs"], want[f"{phase}_msgs"], 0):
            bad.append(f"{phase} ledger {got} != formula {want[phase]} bytes, {want[phase + '_msgs']} messages "
                       f"(and no other traffic)")
    return [f"rank {rank} {variant} N={N} h={h} g={g} causal={causal}: {b}" for b in bad]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("variant,N,h,g,causal", [
    ("ring", 2, 4, 2, True), ("ring", 3, 4, 4, True), ("ring", 2, 2, 1, False),
    ("all-to-all", 2, 4, 2, True), ("all-to-all", 3, 6, 3, True),
])
def test_attention_on_ranks_equals_one_process_and_the_byte_formulas(variant, N, h, g, causal):
    run_ranks(_attention_rank, N, variant, h, g, causal, timeout=75)


def test_byte_formulas():
    # ring: the pair [k, v] of b*g*L*d elements, N-1 hops forward; backward N-1 more and N of [dk, dv]
    pair = 2 * (2 * 4 * 8 * 4) * 8  # b=2, g=4, L=8, d=4, fp64
    assert ring_bytes(2, 4, 8, 4, 2, 8) == {"forward": pair, "backward": 3 * pair, "forward_msgs": 1,
                                            "backward_msgs": 3} and pair == 4096
    assert ring_bytes(1, 1, 1, 1, 4, 1)["forward"] * 7 == ring_bytes(1, 1, 1, 1, 4, 1)["backward"] * 3
    # all-to-all: (N-1)/N of q, k, v and the output, each way (h=4 query heads, g=2 kv heads)
    q, kv = 2 * 4 * 8 * 4 * 8, 2 * 2 * 8 * 4 * 8
    assert ulysses_bytes(2, 4, 2, 8, 4, 2, 8) == {"forward": (2 * q + 2 * kv) // 2, "backward": (2 * q + 2 * kv) // 2,
                                                  "forward_msgs": 4, "backward_msgs": 4}
    # with h = g and N = 2 the two move the same forward; at N = 4 the all-to-all moves half the ring's
    for N, ratio in ((2, 1.0), (4, 0.5)):
        r, u = ring_bytes(1, 8, 64, 16, N), ulysses_bytes(1, 8, 8, 64, 16, N)
        assert u["forward"] / r["forward"] == ratio


def _bad_variant(rank: int) -> list[str]:
    problems = []
    cp = ContextParallel(None, "all-to-all")
    q, k, v = (t.narrow(2, 0, 8) for t in _qkv(1, 3, 3, 8, 4))
    try:
        cp.attend(q, k, v)
        problems.append("3 heads on 2 ranks were not refused")
    except ConfigError as e:
        if str(e) != ("context parallelism (cp=2, all-to-all) does not fit this attention: the all-to-all gives every "
                      "rank whole heads, but query heads=3, key/value heads=3 are not divisible by cp=2; choose cp "
                      "among 1, 3, or the ring variant (--cp-algorithm ring), which splits no heads"):
            problems.append(str(e))
    with comm.ledger() as led:
        try:
            ContextParallel(None, "ring").attend(q, k, v, dropout_p=0.1)
            problems.append("dropout was not refused")
        except ConfigError:
            pass
    if led.total().calls or led.total().msgs_sent:
        problems.append("a refused call sent something")
    try:
        ContextParallel(None, "stripes")
        problems.append("an unknown variant was accepted")
    except ConfigError as e:
        if "unknown variant 'stripes'; use ring" not in str(e):
            problems.append(str(e))
    return problems


@pytest.mark.timeout(60)
def test_bad_attention_inputs_refused_before_any_message():
    run_ranks(_bad_variant, 2, timeout=45)


def _model_bytes_rank(rank: int, model: str, variant: str) -> dict:
    from distrain.models import build_model, lm_loss
    from distrain.parallel import parallelize
    from distrain.models.registry import model_cp_plan

    torch.manual_seed(0)
    net = build_model(model).double()
    c = net.config
    topo = Topology.from_world(cp=2)
    pm = parallelize(net, topo, loss_fn=lm_loss, cp_plan=model_cp_plan(net), cp_algorithm=variant)
    ids = torch.randint(0, 256, (4, c.block_size + 1), generator=torch.Generator().manual_seed(3))
    with comm.ledger() as led:
        pm.train_step(ids[:, :-1], ids[:, 1:])
    label = "cp-ring" if variant == "ring" else "cp-all-to-all"
    got = led.get(label, "p2p")
    return {"sent": got.bytes_sent, "recv": got.bytes_recv, "msgs": got.msgs_sent, "n_layer": c.n_layer,
            "h": c.n_head, "g": getattr(c, "n_kv_head", c.n_head), "d": c.n_embd // c.n_head, "T": c.block_size}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("model,variant", [("gpt-tiny", "ring"), ("gpt-tiny", "all-to-all"),
                                           ("llama-tiny", "ring"), ("llama-tiny", "all-to-all")])
def test_a_training_step_sends_the_formula_bytes(model, variant):
    """One training step of a whole model under cp=2: n_layer attentions, each the formula's bytes
    forward and backward (the ring passes the n_kv_head heads, not the expanded ones)."""
    for r in distrain.spawn(_model_bytes_rank, 2, args=(model, variant), timeout=75):
        N, L = 2, r["T"] // 2
        f = ring_bytes(4, r["g"], L, r["d"], N, 8) if variant == "ring" else ulysses_bytes(4, r["h"], r["g"], L,
                                                                                             r["d"], N, 8)
        per_step = r["n_layer"] * (f["forward"] + f["backward"])
        assert (r["sent"], r["recv"], r["msgs"]) == (per_step, per_step,
                                                     r["n_layer"] * (f["forward_msgs"] + f["backward_msgs"]))


def test_bench_layouts_take_cp_grids():
    from distrain.bench.train.layout_plan import Layout, parse_layout, plan_jobs

    assert parse_layout("dp2xcp2") == Layout("dp2xcp2", dp=2, cp=2)
    jobs, notes = plan_jobs([2, 4], [parse_layout(s) for s in ("cp2", "cp4", "dp2xcp2")])
    assert [(j.nproc, j.layout, j.grid, j.aliases) for j in jobs] == [
        (1, "single", "dp1×tp1×pp1", ()), (2, "cp2", "dp1×cp2×tp1×pp1", ()),
        (4, "cp2", "dp2×cp2×tp1×pp1", ("dp2xcp2",)), (4, "cp4", "dp1×cp4×tp1×pp1", ())]
    assert notes[:2] == ["cp4: cp*tp*pp = 4 does not divide P=2; skipped at P=2",
                         "dp2xcp2 needs exactly dp*cp*tp*pp = 4 processes; skipped at P=2"]
