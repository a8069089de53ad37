"""Tensor parallelism (Megatron-LM) equals one process: loss, gradient shards, parameters
after optimizer steps (fp64); the parallel MLP and the vocab-parallel loss alone; the exact
all-reduce accounting; the divisibility errors, raised before any collective."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import distrain
from distrain import comm
from distrain.comm.algorithms.cost import traffic
from distrain.errors import ConfigError
from distrain.models import GPTConfig, MLPBlock, build_model, generate, lm_loss
from distrain.models.gpt.plan import check_tp_sizes, gpt_tp_plan, tp_all_reduces_per_step
from distrain.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    apply_tensor_parallel,
    megatron_bytes_per_block,
    tp_loss,
    tp_shard_info,
    vocab_parallel_cross_entropy,
)

from conftest import run_ranks

GPT_PLAN = gpt_tp_plan()

B, T = 2, 16
STEPS = 3


def _batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    idx = torch.randint(0, 256, (B, T + 1), generator=g)
    return idx[:, :-1], idx[:, 1:]


def _full_model(**over) -> nn.Module:
    torch.manual_seed(0)
    return build_model("gpt-tiny", **over).double()


def _optimizer(params, name: str):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _expected_shard(name: str, full: torch.Tensor, r: int, P: int, n_head: int = 4) -> torch.Tensor:
    """The slice of a full parameter (or gradient) that tp rank r must hold, written from the
    paper's layout independently of the code under test."""
    if re.search(r"attn\.[qkv]_proj\.(weight|bias)$", name):  # whole heads: rows of head blocks
        hd = full.shape[0] // n_head
        per = n_head // P
        heads = full.reshape(n_head, hd, *full.shape[1:])
        return heads[r * per:(r + 1) * per].reshape(per * hd, *full.shape[1:])
    if name.endswith(("attn.o_proj.weight", "mlp.proj.weight")):  # row-parallel: input columns
        return full.chunk(P, dim=1)[r]
    if name.endswith(("mlp.fc.weight", "mlp.fc.bias", "wte.weight", "lm_head.weight")):  # rows
        return full.chunk(P, dim=0)[r]
    return full  # replicated: LayerNorms, wpe, row-parallel biases


def _close(a: torch.Tensor, b: torch.Tensor, rtol=1e-10, atol=1e-13) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------
# The whole GPT against one process
# ---------------------------------------------------------------------------------------

def _reference_run(opt_name: str) -> dict:
    """The one-process run every algorithm is held to: the initial parameters, each step's loss, the first
    step's gradients and the parameters after STEPS steps (fp64, the same seed and batches each time, so one
    run serves every algorithm of a rank)."""
    ref = _full_model()
    ref_opt = _optimizer(ref.parameters(), opt_name)
    ref_params = dict(ref.named_parameters())
    run = {"initial": {n: p.detach().clone() for n, p in ref_params.items()}, "losses": [], "grads": None}
    for s in range(STEPS):
        x, y = _batch(s)
        ref_opt.zero_grad()
        ref_loss = lm_loss(ref(x), y)
        ref_loss.backward()
        run["losses"].append(ref_loss.detach())
        if s == 0:
            run["grads"] = {n: p.grad.detach().clone() for n, p in ref_params.items()}
        ref_opt.step()
    run["final"] = {n: p.detach().clone() for n, p in ref_params.items()}
    return run


def _gpt_matches_reference(rank: int, algs: list[str], opts: list[str]) -> list[str]:
    P = dist.get_world_size()
    bad: list[str] = []
    refs = {opt_name: _reference_run(opt_name) for opt_name in opts}
    for alg in algs:
        for opt_name in opts:
            ref = refs[opt_name]
            tpm = apply_tensor_parallel(_full_model(), None, alg, plan=GPT_PLAN)
            tp_opt = _optimizer(tpm.parameters(), opt_name)
            info = tp_shard_info(tpm)
            tag = f"rank {rank} tp={P} {alg} {opt_name}"
            if {(i.tp_rank, i.tp_size) for i in info.values()} != {(rank, P)}:
                bad.append(f"{tag}: shard info ranks {set((i.tp_rank, i.tp_size) for i in info.values())}")
            for name, p in tpm.named_parameters():
                want = _expected_shard(name, ref["initial"][name], rank, P)
                if not torch.equal(p.detach(), want) or not torch.equal(info[name].take(ref["initial"][name]), want):
                    bad.append(f"{tag}: initial shard or shard info of {name} is not the expected slice")
            for s in range(STEPS):
                x, y = _batch(s)
                tp_opt.zero_grad()
                ref_loss = ref["losses"][s]
                shard = tpm(x)
                if shard.shape != (B, T, 256 // P):
                    bad.append(f"{tag}: logits shard has shape {tuple(shard.shape)}")
                loss = tp_loss(shard, y, None, alg)
                loss.backward()
                if not _close(loss.detach(), ref_loss):
                    bad.append(f"{tag} step {s}: loss {loss.item()!r} != reference {ref_loss.item()!r}")
                if s == 0:
                    for name, p in tpm.named_parameters():
                        want = _expected_shard(name, ref["grads"][name], rank, P)
                        if not _close(p.grad, want):
                            err = (p.grad - want).abs().max().item() if p.grad.shape == want.shape else "shape"
                            bad.append(f"{tag}: gradient of {name} differs from the reference slice ({err})")
                    bad += _replicated_grads_identical(tpm, tag)
                tp_opt.step()
            for name, p in tpm.named_parameters():
                want = _expected_shard(name, ref["final"][name], rank, P)
                if not _close(p.detach(), want, rtol=1e-9, atol=1e-12):
                    bad.append(f"{tag}: parameter {name} after {STEPS} steps differs from the reference slice")
    return bad


def _replicated_grads_identical(model: nn.Module, tag: str) -> list[str]:
    """LayerNorms, wpe, row-parallel biases: the same gradient on every tp rank (f/g at work)."""
    info = tp_shard_info(model)
    names = [n for n, i in info.items() if i.dim is None]
    params = dict(model.named_parameters())
    mine = torch.cat([params[n].grad.reshape(-1) for n in names])
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [f"{tag}: replicated gradients differ between tp rank 0 and {r} (max {(row - rows[0]).abs().max()})"
            for r, row in enumerate(rows) if not torch.equal(row, rows[0])] + \
        ([] if {n.split(".")[-2] for n in names} >= {"ln_1", "ln_2", "ln_f", "wpe"} else [f"{tag}: {names}"])


@pytest.mark.timeout(90)
def test_gpt_tp2_ring_tree_star_equals_one_process():
    run_ranks(_gpt_matches_reference, 2, ["ring", "tree", "star"], ["sgd", "adam"], timeout=80)


@pytest.mark.timeout(90)
def test_gpt_tp4_native_equals_one_process():
    run_ranks(_gpt_matches_reference, 4, ["native"], ["sgd", "adam"], timeout=80)


# ---------------------------------------------------------------------------------------
# Parts alone: the MLP, the edge layers, the loss
# ---------------------------------------------------------------------------------------

def test_split_by_columns_then_rows_is_the_same_mlp():
    """The seeds' example, in plain torch: GeLU(X A) B == sum_r GeLU(X A_r) B_r, with A split by
    columns (output features) and B by rows (input features): no communication inside."""
    g = torch.Generator().manual_seed(0)
    X = torch.randn(5, 8, generator=g, dtype=torch.float64)
    A = torch.randn(8, 32, generator=g, dtype=torch.float64)
    Bm = torch.randn(32, 8, generator=g, dtype=torch.float64)
    full = F.gelu(X @ A) @ Bm
    for P in (2, 4, 8):
        parts = sum(F.gelu(X @ a) @ b for a, b in zip(A.chunk(P, dim=1), Bm.chunk(P, dim=0)))
        assert torch.allclose(parts, full, rtol=1e-12, atol=1e-12)


def _parts_match(rank: int) -> list[str]:
    P = dist.get_world_size()
    bad = []
    torch.manual_seed(0)
    mlp = MLPBlock(GPTConfig(n_embd=32, n_head=4)).double()
    x = torch.randn(B, T, 32, dtype=torch.float64, requires_grad=True)  # same on every rank (seed)
    out = mlp(x)
    out.pow(2).sum().backward()
    pmlp = copy.deepcopy(mlp)
    pmlp.fc = ColumnParallelLinear.from_linear(mlp.fc, None, "ring")
    pmlp.proj = RowParallelLinear.from_linear(mlp.proj, None, "ring")
    px = x.detach().clone().requires_grad_(True)
    with comm.ledger() as led:
        pout = pmlp(px)
        n_fwd = led.get("all_reduce", "ring").calls
        pout.pow(2).sum().backward()
    if not _close(pout, out):
        bad.append(f"rank {rank}: parallel MLP output differs by {(pout - out).abs().max().item()}")
    if not _close(px.grad, x.grad):
        bad.append(f"rank {rank}: parallel MLP input gradient differs")
    if (n_fwd, led.get("all_reduce", "ring").calls) != (1, 2):
        bad.append(f"rank {rank}: parallel MLP all-reduces fwd {n_fwd}, total {led.get('all_reduce', 'ring').calls}")
    checks = [(pmlp.fc.weight.grad, mlp.fc.weight.grad.chunk(P, 0)[rank]),
              (pmlp.fc.bias.grad, mlp.fc.bias.grad.chunk(P, 0)[rank]),
              (pmlp.proj.weight.grad, mlp.proj.weight.grad.chunk(P, 1)[rank]),
              (pmlp.proj.bias.grad, mlp.proj.bias.grad)]
    bad += [f"rank {rank}: MLP parameter gradient {i} differs" for i, (a, b) in enumerate(checks) if not _close(a, b)]

    # The edge variants: column with gather_output, row with a replicated input.
    lin = nn.Linear(32, 12).double()
    col = ColumnParallelLinear.from_linear(lin, None, "tree", gather_output=True)
    row = RowParallelLinear.from_linear(lin, None, "tree", input_is_parallel=False)
    for what, layer in (("column gather_output", col), ("row input_is_parallel=False", row)):
        xi = x.detach().clone().requires_grad_(True)
        xr = x.detach().clone().requires_grad_(True)
        lin.zero_grad()
        y_ref = lin(xr)
        y_ref.sum().backward()
        y = layer(xi)
        y.sum().backward()
        if not (_close(y, y_ref) and _close(xi.grad, xr.grad)):
            bad.append(f"rank {rank}: {what} differs from nn.Linear")
    if (col.out_features, col.local_out_features, row.in_features, row.local_in_features) != (12, 12 // P, 32, 32 // P):
        bad.append(f"rank {rank}: feature attributes {col.out_features, col.local_out_features, row.in_features}")
    return bad


def _ce_matches(rank: int) -> list[str]:
    P = dist.get_world_size()
    bad = []
    g = torch.Generator().manual_seed(7)
    for shift, ignore in ((0.0, False), (1000.0, False), (0.0, True)):
        logits = (3 * torch.randn(3, 5, 24, generator=g, dtype=torch.float64) + shift).requires_grad_(True)
        targets = torch.randint(0, 24, (3, 5), generator=g)
        if ignore:
            targets[0, :3] = -100
        ref = F.cross_entropy(logits.reshape(-1, 24), targets.reshape(-1))
        ref.backward()
        shard = logits.detach().chunk(P, dim=-1)[rank].clone().requires_grad_(True)
        with comm.ledger() as led:
            loss = vocab_parallel_cross_entropy(shard, targets, None, "ring")
        loss.backward()
        tag = f"rank {rank} shift {shift} ignore {ignore}"
        if not _close(loss.detach(), ref.detach(), rtol=1e-12):
            bad.append(f"{tag}: loss {loss.item()!r} != {ref.item()!r}")
        if not _close(shard.grad, logits.grad.chunk(P, dim=-1)[rank], rtol=1e-12, atol=1e-15):
            bad.append(f"{tag}: gradient shard differs")
        c = led.get("all_reduce", "ring")
        if (c.calls, c.payload_bytes, led.total().calls) != (3, 3 * 15 * 8, 3):
            bad.append(f"{tag}: collectives {led.as_dict()}")
    with comm.ledger() as led:
        try:
            vocab_parallel_cross_entropy(shard, torch.full((3, 5), 24), None, "ring")
            bad.append(f"rank {rank}: a target outside the vocabulary was accepted")
        except ConfigError as e:
            if "targets must lie in [0, 24)" not in str(e) or led.total().calls:
                bad.append(f"rank {rank}: bad target: {e} / {led.as_dict()}")
    return bad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [2, 4])
def test_parallel_mlp_and_vocab_parallel_cross_entropy(P):
    res = distrain.spawn(_parts_match, P, timeout=45) + distrain.spawn(_ce_matches, P, timeout=45)
    bad = [x for r in res for x in r]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------
# Exact all-reduce accounting
# ---------------------------------------------------------------------------------------

def _ledger_counts(rank: int) -> dict:
    P = dist.get_world_size()
    C = 32
    model = apply_tensor_parallel(_full_model(), None, "ring", plan=GPT_PLAN)
    x, y = _batch(0)
    out = {}
    # One block alone: 2 all-reduces forward (g after o_proj, g after mlp.proj), 2 backward (the f's).
    block = model.layers[1]
    h = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    with comm.ledger() as led_f:
        z = block(h)
    with comm.ledger() as led_b:
        z.sum().backward()
    out["block"] = [(led.get("all_reduce", "ring").calls, led.get("all_reduce", "ring").payload_bytes,
                     led.get("all_reduce", "ring").bytes_sent, led.total().calls) for led in (led_f, led_b)]
    # The whole model: forward + loss, then backward.
    with comm.ledger() as led_f:
        loss = tp_loss(model(x), y, None, "ring")
    with comm.ledger() as led_b:
        loss.backward()
    out["model"] = [(led.get("all_reduce", "ring").calls, led.get("all_reduce", "ring").payload_bytes,
                     led.get("all_reduce", "ring").bytes_sent, led.get("all_reduce", "ring").bytes_recv,
                     led.total().calls) for led in (led_f, led_b)]
    # A tp group of one rank issues no collective and is the plain model.
    solo = [dist.new_group([r]) for r in range(P)][rank]
    ref = _full_model()
    one = apply_tensor_parallel(_full_model(), solo, "ring", plan=GPT_PLAN)
    with comm.ledger() as led:
        l1 = tp_loss(one(x), y, solo, "ring")
        l1.backward()
    out["solo"] = (led.total().calls, torch.equal(l1, lm_loss(ref(x), y)))
    # gather_logits=True: the full logits on every rank, so generate() works unchanged.
    full = apply_tensor_parallel(_full_model(), None, "ring", plan=gpt_tp_plan(gather_logits=True))
    out["gathered"] = _close(full(x), ref(x)) and torch.equal(
        generate(full, x[:, :4], 8, temperature=0), generate(ref, x[:, :4], 8, temperature=0))
    twin = copy.deepcopy(model)  # copies share the group
    out["deepcopy"] = torch.equal(tp_loss(twin(x), y, None, "ring"), loss)
    return out


@pytest.mark.timeout(60)
def test_ledger_all_reduces_per_step_are_exactly_megatrons():
    P, C, L, e = 2, 32, 4, 8
    res = distrain.spawn(_ledger_counts, P, timeout=45)
    fwd_b, bwd_b = megatron_bytes_per_block(B, T, C, e)
    assert (fwd_b, bwd_b) == (2 * B * T * C * e, 2 * B * T * C * e) == (16384, 16384)
    plan = tp_all_reduces_per_step(L, B, T, C, e)
    act, tok = B * T * C * e, B * T * e
    # forward: embedding g + 2 per block + the loss's max, target logit, sum of exp
    assert [n for _, n in plan["forward"]] == [act] + [act] * 2 * L + [tok] * 3
    # backward: lm_head f + 2 per block (mlp f, attn f); the embedding's g and the loss: none
    assert [n for _, n in plan["backward"]] == [act] + [act] * 2 * L
    for rank, r in enumerate(res):
        sent = lambda n: traffic("all_reduce", "ring", P, rank, n // e, e)[0]  # noqa: E731
        assert r["block"] == [(2, fwd_b, 2 * sent(act), 2), (2, bwd_b, 2 * sent(act), 2)]
        f_calls, f_payload = 1 + 2 * L + 3, (1 + 2 * L) * act + 3 * tok
        b_calls, b_payload = 1 + 2 * L, (1 + 2 * L) * act
        assert (f_calls, f_payload, b_calls, b_payload) == (12, 74496, 9, 73728)
        assert f_payload == sum(n for _, n in plan["forward"]) and b_payload == sum(n for _, n in plan["backward"])
        f_sent = sum(sent(n) for _, n in plan["forward"])
        b_sent = sum(sent(n) for _, n in plan["backward"])
        assert r["model"] == [(f_calls, f_payload, f_sent, f_sent, f_calls),
                              (b_calls, b_payload, b_sent, b_sent, b_calls)]
        assert r["solo"] == (0, True)
        assert r["deepcopy"] and r["gathered"]


# ---------------------------------------------------------------------------------------
# Errors, before anything happens
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("tp, sizes, msg", [
    (3, dict(n_head=4, n_embd=33, mlp_hidden=132, vocab_size=255),
     "n_head=4 is not divisible by tp=3; choose tp among the divisors of 4: 1, 2, 4"),
    (4, dict(n_head=4, n_embd=30, mlp_hidden=120, vocab_size=256),
     "n_embd=30 is not divisible by tp=4; choose tp among the divisors of 30: 1, 2, 3, 5, 6, 10, 15, 30"),
    (4, dict(n_head=4, n_embd=32, mlp_hidden=126, vocab_size=256),
     "4*n_embd=126 is not divisible by tp=4; choose tp among the divisors of 126: "
     "1, 2, 3, 6, 7, 9, 14, 18, 21, 42, 63, 126"),
    (2, dict(n_head=4, n_embd=32, mlp_hidden=128, vocab_size=255),
     "vocab_size=255 is not divisible by tp=2; choose tp among the divisors of 255: 1, 3, 5, 15, 17, 51, 85, 255"),
])
def test_check_tp_sizes_names_each_size(tp, sizes, msg):
    with pytest.raises(ConfigError, match=re.escape(msg)):
        check_tp_sizes(tp, **sizes)
    check_tp_sizes(1, **sizes)


def test_apply_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("this process already has a process group")
    with pytest.raises(ConfigError, match="torch.distributed is not initialized"):
        apply_tensor_parallel(_full_model(), plan=GPT_PLAN)


def _bad_inputs(rank: int) -> list[str]:
    cases = [
        (dict(n_head=1), "native", "n_head=1 is not divisible by tp=2; choose tp among the divisors of 1: 1"),
        (dict(vocab_size=255), "ring",
         "vocab_size=255 is not divisible by tp=2; choose tp among the divisors of 255: 1, 3, 5, 15, 17, 51, 85, 255"),
        (dict(n_head=3, n_embd=33), "tree",
         "n_head=3 is not divisible by tp=2; choose tp among the divisors of 3: 1, 3. "
         "n_embd=33 is not divisible by tp=2"),
        ({}, "butterfly", "unknown algorithm 'butterfly'"),
    ]
    bad = []
    with comm.ledger() as led:
        for over, alg, msg in cases:
            model = _full_model(**over)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                apply_tensor_parallel(model, None, alg, plan=GPT_PLAN)
                bad.append(f"rank {rank}: {over} {alg}: no error")
            except ConfigError as e:
                if msg not in str(e):
                    bad.append(f"rank {rank}: {over} {alg}: message {e}")
            after = model.state_dict()
            if before.keys() != after.keys() or any(not torch.equal(before[k], after[k]) for k in before) or \
                    any(not isinstance(m, (nn.Linear, nn.Embedding, nn.LayerNorm)) for m in
                        [model.layers[0].wte, model.layers[1].attn.q_proj, model.layers[-1].lm_head]):
                bad.append(f"rank {rank}: {over} {alg}: the model was modified before the error")
        twice = apply_tensor_parallel(_full_model(), None, "native", plan=GPT_PLAN)
        try:
            apply_tensor_parallel(twice, None, "native", plan=GPT_PLAN)
            bad.append(f"rank {rank}: applying twice: no error")
        except ConfigError as e:
            if "already tensor-parallel" not in str(e):
                bad.append(f"rank {rank}: applying twice: {e}")
    if led.total().calls:
        bad.append(f"rank {rank}: collectives ran before the errors: {led.as_dict()}")
    return bad


@pytest.mark.timeout(60)
def test_apply_errors_before_any_collective():
    run_ranks(_bad_inputs, 2, timeout=45)
