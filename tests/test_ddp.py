"""Our DDP equals one process on the global batch (fp64, several optimizer steps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import distrain
from distrain import comm
from distrain.errors import CommError, ConfigError
from distrain.models import build_model, classification_loss, lm_loss
from distrain.parallel.data_parallel import DistributedDataParallel

from conftest import one_process_losses, run_ranks

ALGS = ["native", "star", "ring", "tree"]
STEPS = 4
LOCAL_B = 3


def _data(global_b: int, kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        idx = torch.randint(0, 256, (global_b, 17), generator=g)
        return idx[:, :-1], idx[:, 1:]
    return torch.randn(global_b, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (global_b,), generator=g)


def _model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    m = build_model("gpt-tiny" if kind == "gpt" else "mlp-tiny").double()
    if torch.distributed.is_initialized():  # make replicas differ: DDP's broadcast must fix it
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.distributed.get_rank())
    return m


def _loss(kind, out, y):
    return lm_loss(out, y) if kind == "gpt" else classification_loss(out, y)


def _optimizer(params, name):
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _reference(P: int, kind: str, opt_name: str) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    m = build_model("gpt-tiny" if kind == "gpt" else "mlp-tiny").double()
    losses = one_process_losses(m, _optimizer(m.parameters(), opt_name), lambda out, y: _loss(kind, out, y),
                                (_data(P * LOCAL_B, kind, s) for s in range(STEPS)))
    return losses, [p.detach().clone() for p in m.parameters()]


def _ddp_matches_reference(rank: int, kind: str, opt_name: str, algs: list[str], cap_mb: float) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    ref_losses, ref_params = _reference(P, kind, opt_name)
    bad = []
    for alg in algs:
        model = DistributedDataParallel(_model(kind), algorithm=alg, bucket_cap_mb=cap_mb)
        opt = _optimizer(model.parameters(), opt_name)
        for s in range(STEPS):
            x, y = _data(P * LOCAL_B, kind, s)
            mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
            opt.zero_grad()
            loss = _loss(kind, model(x[mine]), y[mine])
            loss.backward()
            opt.step()
            global_loss = loss.detach().clone()
            comm.all_reduce(global_loss, op="avg")
            if abs(global_loss.item() - ref_losses[s]) > 1e-12 * max(1.0, abs(ref_losses[s])):
                bad.append(f"{alg} step {s}: loss {global_loss.item()!r} != {ref_losses[s]!r}")
        for (name, p), q in zip(model.module.named_parameters(), ref_params):
            if not torch.allclose(p, q, rtol=1e-10, atol=1e-12):
                bad.append(f"P={P} {alg} {name}: max diff {(p - q).abs().max().item():.3e}")
    return bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_ddp_equals_single_process_every_algorithm(P, transport):
    # small buckets: several all-reduces per backward, launched while backward still runs
    run_ranks(_ddp_matches_reference, P, "mlp", "sgd", ALGS, 0.005, timeout=200, env={"DISTRAIN_TRANSPORT": transport})


@pytest.mark.timeout(240)
def test_ddp_equals_single_process_gpt_adam():
    run_ranks(_ddp_matches_reference, 3, "gpt", "adam", ["ring", "tree"], 0.05, timeout=200)


def _no_sync_accumulation(rank: int) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    # one process, one SGD step on the double batch
    torch.manual_seed(0)
    ref = build_model("mlp-tiny").double()
    x, y = _data(2 * P * LOCAL_B, "mlp", 0)
    classification_loss(ref(x), y).backward()
    # DDP: two micro-steps of half the batch each, the first under no_sync
    model = DistributedDataParallel(_model("mlp"), algorithm="ring", bucket_cap_mb=0.005)
    halves = [slice(0, P * LOCAL_B), slice(P * LOCAL_B, 2 * P * LOCAL_B)]
    with comm.ledger() as led:
        for i, h in enumerate(halves):
            xs, ys = x[h], y[h]
            mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
            if i == 0:
                with model.no_sync():
                    (classification_loss(model(xs[mine]), ys[mine]) / 2).backward()
            else:
                (classification_loss(model(xs[mine]), ys[mine]) / 2).backward()
    bad = []
    for (n, p), q in zip(model.module.named_parameters(), ref.parameters()):
        if not torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13):
            bad.append(f"no_sync {n}: grad max diff {(p.grad - q.grad).abs().max().item():.3e}")
    calls = led.get("all_reduce", "ring").calls
    if calls != len(model.bucket_sizes):  # only the synchronized backward communicates
        bad.append(f"{calls} all-reduces for {len(model.bucket_sizes)} buckets")
    return bad


@pytest.mark.timeout(120)
def test_no_sync_accumulation_equals_double_batch():
    run_ranks(_no_sync_accumulation, 2, timeout=90)


class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 2)

    def forward(self, x):
        return self.used(x)


def _unused(rank: int) -> str:
    torch.manual_seed(0)
    model = DistributedDataParallel(_Branchy(), algorithm="tree")
    try:
        model(torch.ones(2, 4)).sum().backward()
        return "no error for an unused parameter"
    except Exception as e:  # noqa: BLE001
        if not isinstance(e, CommError) or "['unused.weight', 'unused.bias']" not in str(e) \
                or "find_unused_parameters=True" not in str(e):
            return f"wrong error: {type(e).__name__}: {e}"
    model = DistributedDataParallel(_Branchy(), algorithm="tree", find_unused_parameters=True)
    model(torch.ones(2, 4) * (rank + 1)).sum().backward()
    if not torch.equal(model.module.unused.weight.grad, torch.zeros(2, 4)):
        return "unused parameter's gradient is not zero"
    want = torch.ones(2, 4) * 3.0  # two rows of (rank + 1), averaged over ranks 0 and 1: 2 * 1.5
    if not torch.allclose(model.module.used.weight.grad, want):
        return f"used gradient {model.module.used.weight.grad}"
    return ""


@pytest.mark.timeout(120)
def test_unused_parameters():
    assert distrain.spawn(_unused, 2, timeout=90) == ["", ""]


def _compressed(rank: int) -> list:
    out = []
    for compression in (None, "bf16"):
        torch.manual_seed(0)
        model = DistributedDataParallel(build_model("mlp-tiny"), algorithm="ring", compression=compression)
        x, y = _data(8, "mlp", rank)
        with comm.ledger() as led:
            classification_loss(model(x[:4].float()), y[:4]).backward()
        out.append((led.get("all_reduce", "ring").payload_bytes,
                    torch.cat([p.grad.flatten() for p in model.module.parameters()])))
    return out


@pytest.mark.timeout(120)
def test_bf16_compression_halves_the_bytes():
    (full_bytes, g32), (half_bytes, g16) = distrain.spawn(_compressed, 2, timeout=90)[0]
    assert half_bytes * 2 == full_bytes == 6570 * 4
    assert torch.allclose(g16, g32, rtol=2e-2, atol=1e-3)
    assert not torch.equal(g16, g32)


def _bad_args(rank: int) -> list[str]:
    errs = []
    for kw, frag in [(dict(algorithm="mesh"), "unknown algorithm 'mesh'"), (dict(compression="int4"), "compression"),
                     (dict(bucket_cap_mb=0), "bucket_cap_mb")]:
        try:
            DistributedDataParallel(nn.Linear(2, 2), **kw)
            errs.append(f"{kw} accepted")
        except ConfigError as e:
            if frag not in str(e):
                errs.append(f"{kw}: {e}")
    return errs


@pytest.mark.timeout(60)
def test_bad_arguments():
    assert distrain.spawn(_bad_args, 2, timeout=45) == [[], []]


def _explicit_sync(rank: int) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    torch.manual_seed(0)
    ref = build_model("mlp-tiny").double()
    x, y = _data(2 * P * LOCAL_B, "mlp", 0)
    classification_loss(ref(x), y).backward()
    model = DistributedDataParallel(_model("mlp"), algorithm="tree")
    mine = [slice(rank * LOCAL_B, (rank + 1) * LOCAL_B), slice((P + rank) * LOCAL_B, (P + rank + 1) * LOCAL_B)]
    with model.no_sync():  # two micro-batches that call the layers directly, as a pipeline stage does
        for m in mine:
            (classification_loss(model.module(x[m]), y[m]) / 2).backward()
    with comm.ledger() as led:
        model.allreduce_gradients()
    bad = [n for (n, p), q in zip(model.module.named_parameters(), ref.parameters())
           if not torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-13)]
    if led.get("all_reduce", "tree").calls != len(model.bucket_sizes):
        bad.append("one all-reduce per bucket expected")
    return bad


@pytest.mark.timeout(120)
def test_allreduce_gradients_after_no_sync_micro_batches():
    assert distrain.spawn(_explicit_sync, 3, timeout=90) == [[], [], []]


def _carry(rank: int) -> list[str]:
    """Values ride with the gradients: their average arrives with the backward, the gradients are the
    same bits as without them, and the values' own collective is not needed (no extra ledger call)."""
    import torch.distributed as dist

    P = dist.get_world_size()
    bad = []
    for alg in ("native", "ring"):
        x, y = _data(P * LOCAL_B, "mlp", 0)
        mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
        grads = []
        for carry in (False, True):
            model = DistributedDataParallel(_model("mlp"), algorithm=alg, bucket_cap_mb=0.005)
            loss = _loss("mlp", model(x[mine]), y[mine])
            if carry:
                model.carry(torch.tensor([float(rank), 1.0 if rank == 0 else 0.0], dtype=torch.float64))
            with comm.ledger() as led:
                loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            calls = led.total("all_reduce").calls
            if carry:
                got = model.carried().tolist()
                want = [sum(range(P)) / P, 1.0 / P]
                if any(abs(g - w) > 1e-15 for g, w in zip(got, want)):
                    bad.append(f"{alg}: carried {got}, want {want}")
                if calls != n_calls:
                    bad.append(f"{alg}: {calls} all-reduces with the values, {n_calls} without")
            n_calls = calls
        if not all(torch.equal(a, b) for a, b in zip(*grads)):
            bad.append(f"{alg}: the gradients changed when values rode with them")
    return bad


@pytest.mark.timeout(60)
def test_values_carried_with_the_gradients_arrive_averaged_and_change_nothing_else():
    run_ranks(_carry, 3, timeout=50)


def _carry_refused(rank: int) -> list[str]:
    from conftest import expect_error

    model = DistributedDataParallel(_model("mlp"), compression="bf16")
    return [expect_error(lambda: model.carry(torch.zeros(2)), ConfigError,
                         "the buckets are reduced by a comm hook or compressed")]


@pytest.mark.timeout(60)
def test_carry_is_refused_where_values_cannot_ride():
    run_ranks(_carry_refused, 2, timeout=50)
