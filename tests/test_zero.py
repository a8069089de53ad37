"""ZeRO stages 1-3 equal one process (fp64, several optimizer steps); exact bytes; checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import distrain
from distrain import comm
from distrain.comm.algorithms.cost import traffic
from distrain.errors import ConfigError
from distrain.models import build_model, classification_loss, lm_loss
from distrain.parallel.zero import Zero

from conftest import run_ranks

STEPS = 4
LOCAL_B = 3
CLIP = 0.05  # small enough that clipping acts on every step


def _data(global_b: int, kind: str, step: int):
    g = torch.Generator().manual_seed(100 + step)
    if kind == "gpt":
        idx = torch.randint(0, 256, (global_b, 17), generator=g)
        return idx[:, :-1], idx[:, 1:]
    return torch.randn(global_b, 64, generator=g, dtype=torch.float64), torch.randint(0, 10, (global_b,), generator=g)


def _model(kind: str, perturb: bool = True) -> nn.Module:
    torch.manual_seed(0)
    m = build_model("gpt-tiny" if kind == "gpt" else "mlp-tiny").double()
    if perturb and torch.distributed.is_initialized():  # replicas differ: the engine's broadcast must fix it
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.01 * torch.distributed.get_rank())
    return m


def _loss(kind, out, y):
    return lm_loss(out, y) if kind == "gpt" else classification_loss(out, y)


def _opt(name):
    if name == "adamw":
        return lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)
    return lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)


def _reference(B: int, kind: str, opt_name: str, steps: int = STEPS, clip: float | None = CLIP):
    """One process on the global batch of B rows."""
    m = _model(kind, perturb=False)
    opt = _opt(opt_name)(list(m.parameters()))
    losses = []
    for s in range(steps):
        x, y = _data(B, kind, s)
        opt.zero_grad()
        loss = _loss(kind, m(x), y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, m, opt


def _train(engine, kind, rank, P, B, steps, clip=CLIP, first=0):
    """Steps first..first+steps-1 of a global batch of B rows, B/P rows on each rank."""
    losses = []
    for s in range(first, first + steps):
        x, y = _data(B, kind, s)
        mine = slice(rank * (B // P), (rank + 1) * (B // P))
        engine.zero_grad()
        loss = _loss(kind, engine(x[mine]), y[mine])
        loss.backward()
        if clip:
            engine.clip_grad_norm_(clip)
        engine.step()
        g = loss.detach().clone()
        comm.all_reduce(g, op="avg")
        losses.append(g.item())
    return losses


def _compare(tag, losses, ref_losses, full, ref_model, ref_opt) -> list[str]:
    bad = [f"{tag} step {s}: loss {a!r} != {b!r}" for s, (a, b) in enumerate(zip(losses, ref_losses))
           if abs(a - b) > 1e-11 * max(1.0, abs(b))]
    names = dict(ref_model.named_parameters())
    for n, p in names.items():
        if not torch.allclose(full["model"][n], p, rtol=1e-10, atol=1e-12):
            bad.append(f"{tag} {n}: max diff {(full['model'][n] - p).abs().max().item():.3e}")
        for k, v in ref_opt.state[p].items():
            got = full["optimizer"]["state"][n][k]
            if not torch.allclose(torch.as_tensor(got, dtype=torch.float64), v.double(), rtol=1e-9, atol=1e-12):
                bad.append(f"{tag} optimizer {n}.{k} differs")
    return bad


def _equivalence(rank: int, kind: str, opt_name: str, stages: list[int], alg: str) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    shm = alg == "native-shm"  # the shared-memory transport: stages 1-2 on symmetric memory
    if shm:
        comm.set_transport("shm")
        alg = "native"
    ref_losses, ref_model, ref_opt = _reference(P * LOCAL_B, kind, opt_name)
    bad = []
    for stage in stages:
        engine = Zero(_model(kind), _opt(opt_name), stage=stage, algorithm=alg, bucket_cap_mb=0.005)
        if shm and stage < 3 and not (engine.impl.symmetric and len(engine.impl.pool) == 2 and
                                      len(engine.impl.units) > 2):
            bad.append(f"P={P} stage {stage}: not on symmetric memory with a pool of 2 reused buffers")
        losses = _train(engine, kind, rank, P, P * LOCAL_B, STEPS)
        x, _ = _data(P * LOCAL_B, kind, 99)
        with torch.no_grad():  # evaluation: no autograd, stage 3 still gathers layer by layer
            engine.eval()
            if not torch.allclose(engine(x), ref_model(x), rtol=1e-9, atol=1e-12) or engine.training:
                bad.append(f"P={P} stage {stage}: eval forward differs from the reference")
            engine.train()
        bad += _compare(f"P={P} stage {stage}", losses, ref_losses, engine.full_state_dict(), ref_model, ref_opt)
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P,opt_name,alg", [(2, "adamw", "ring"), (3, "sgd", "ring"), (3, "adamw", "native"),
                                             (3, "adamw", "native-shm"), (2, "sgd", "native-shm")])
def test_every_stage_equals_one_process_mlp(P, opt_name, alg):
    # mlp-tiny's units (4160, 2080, 330 elements; buckets of 5 KB) are not divisible by 3
    run_ranks(_equivalence, P, "mlp", opt_name, [1, 2, 3], alg, timeout=250)


class _Mixed(nn.Module):
    """A float64 layer (registered first), then a float32 one: ZeRO's units are split by dtype."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 24).double(), nn.Linear(24, 10)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.double())).float())


def _mixed_dtypes(rank: int) -> list[str]:
    import torch.distributed as dist

    comm.set_transport("shm")
    P = dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(P * LOCAL_B, 16, generator=g) for _ in range(STEPS)]
    ys = [torch.randint(0, 10, (P * LOCAL_B,), generator=g) for _ in range(STEPS)]
    ref = _Mixed()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        classification_loss(ref(x), y).backward()
        opt.step()
    engine = Zero(_Mixed(), lambda ps: torch.optim.SGD(ps, lr=0.1), stage=2, algorithm="native", bucket_cap_mb=0.001)
    mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    for x, y in zip(xs, ys):
        engine.zero_grad()
        classification_loss(engine(x[mine]), y[mine]).backward()
        engine.step()
    bad = [] if engine.impl.symmetric and {u[0].dtype for u in engine.impl.params} == {torch.float32, torch.float64} \
        else ["not on symmetric memory with units of both dtypes"]
    full = engine.full_state_dict()["model"]
    for n, p in ref.named_parameters():  # float32 in the chain: the halves' sums are reordered, 1e-5
        if full[n].dtype != p.dtype or not torch.allclose(full[n], p, rtol=1e-5, atol=0):
            bad.append(f"{n}: {full[n].dtype} vs {p.dtype}, max diff {(full[n].double() - p.double()).abs().max():.3e}")
    return bad


@pytest.mark.timeout(120)
def test_units_of_two_dtypes_share_the_symmetric_gradient_pool():
    """The pool holds bytes: each unit views it in its own dtype (a float32 unit beside float64 ones)."""
    run_ranks(_mixed_dtypes, 2, timeout=100)


@pytest.mark.timeout(300)
def test_every_stage_equals_one_process_gpt_adamw_clipped():
    run_ranks(_equivalence, 3, "gpt", "adamw", [1, 2, 3], "tree", timeout=250)


def _bytes(rank: int, kind: str, input_grad: bool = False) -> dict:
    """Bytes sent by this rank in one training step, per stage and for our DDP, with the formulas."""
    import torch.distributed as dist

    from distrain.parallel.data_parallel import DistributedDataParallel

    P = dist.get_world_size()
    x, y = _data(P * LOCAL_B, kind, 0)
    mine = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    if input_grad:  # the first layer then needs its weight in backward too (for the input's gradient)
        x.requires_grad_(True)
    out = {}
    for stage in (1, 2, 3):
        engine = Zero(_model(kind), _opt("adamw"), stage=stage, algorithm="ring", bucket_cap_mb=0.005)
        with comm.ledger() as led:
            _loss(kind, engine(x[mine]), y[mine]).backward()
            engine.step()
        S = [u.shard for u in engine.units]
        gathers = 1 if stage < 3 else 2
        skip = sum(u.shard for u, need in zip(engine.units, getattr(engine.impl, "_needs_bwd", [])) if not need)
        want_ag = sum(traffic("all_gather", "ring", P, rank, s, 8)[0] for s in S) * gathers \
            - traffic("all_gather", "ring", P, rank, skip, 8)[0]
        want_rs = sum(traffic("reduce_scatter", "ring", P, rank, s, 8)[0] for s in S)
        out[stage] = dict(ag=led.bytes_sent("all_gather", "ring"), rs=led.bytes_sent("reduce_scatter", "ring"),
                          want_ag=want_ag, want_rs=want_rs, ag_calls=led.get("all_gather", "ring").calls,
                          units=len(S), closed=(P - 1) * 8 * sum(S), skipped=(P - 1) * 8 * skip)
    ddp = DistributedDataParallel(_model(kind), algorithm="ring", bucket_cap_mb=0.005)
    with comm.ledger() as led:
        _loss(kind, ddp(x[mine]), y[mine]).backward()
    out["ddp"] = led.bytes_sent("all_reduce", "ring")
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("P,input_grad", [(2, True), (3, True), (3, False)])
def test_bytes_per_step_match_the_formulas(P, input_grad):
    for rank, r in enumerate(distrain.spawn(_bytes, P, args=("mlp", input_grad), timeout=150)):
        for stage in (1, 2, 3):
            d = r[stage]
            assert d["rs"] == d["want_rs"] == d["closed"], (rank, stage, d)
            assert d["ag"] == d["want_ag"] == d["closed"] * (1 if stage < 3 else 2) - d["skipped"], (rank, stage, d)
        # without an input gradient the first Linear's backward needs no weight: no second gather for it
        assert r[3]["skipped"] == (0 if input_grad else (P - 1) * 8 * -(-4160 // P)), r[3]
        if P == 2:  # every unit even: ZeRO-1/2 move exactly DDP's volume, ZeRO-3 1.5x
            assert r[1]["ag"] + r[1]["rs"] == r[2]["ag"] + r[2]["rs"] == r["ddp"] == 6570 * 8
            assert 2 * (r[3]["ag"] + r[3]["rs"]) == 3 * r["ddp"]


@pytest.mark.timeout(200)
def test_stage3_skips_the_backward_gather_of_the_embedding():
    for r in distrain.spawn(_bytes, 3, args=("gpt",), timeout=150):
        d = r[3]
        assert d["ag_calls"] == 2 * d["units"] - 1  # the Embedding's backward needs only the indices
        assert d["ag"] == d["want_ag"] and d["rs"] == d["want_rs"] == d["closed"]



def _accumulation(rank: int) -> list[str]:
    """Two backward passes of half the batch per step equal one process on the whole batch."""
    import torch.distributed as dist

    P = dist.get_world_size()
    B = 2 * P * LOCAL_B
    ref_losses, ref_model, ref_opt = _reference(B, "mlp", "adamw", steps=3)
    bad = []
    for stage in (1, 2, 3):
        engine = Zero(_model("mlp"), _opt("adamw"), stage=stage, algorithm="ring", bucket_cap_mb=0.005)
        for s in range(3):
            x, y = _data(B, "mlp", s)
            engine.zero_grad()
            for half in (0, 1):
                rows = slice(half * B // 2 + rank * LOCAL_B, half * B // 2 + (rank + 1) * LOCAL_B)
                (_loss("mlp", engine(x[rows]), y[rows]) / 2).backward()
            engine.clip_grad_norm_(CLIP)
            engine.step()
        bad += _compare(f"accumulation stage {stage}", [], [], engine.full_state_dict(), ref_model, ref_opt)
    return bad


@pytest.mark.timeout(200)
def test_gradient_accumulation_over_two_backward_passes():
    run_ranks(_accumulation, 3, timeout=150)


def _save_full(rank: int, path: str, stage: int) -> list[float]:
    import torch.distributed as dist

    engine = Zero(_model("gpt"), _opt("adamw"), stage=stage, algorithm="ring", bucket_cap_mb=0.01)
    losses = _train(engine, "gpt", rank, dist.get_world_size(), 6, 2)
    full = engine.full_state_dict()
    if rank == 0:
        torch.save(full, path)
    return losses


def _resume_full(rank: int, path: str, stage: int) -> tuple[list[float], dict]:
    import torch.distributed as dist

    full = torch.load(path, weights_only=True)
    engine = Zero(_model("gpt"), _opt("adamw"), stage=stage, algorithm="tree", bucket_cap_mb=0.02)
    engine.load_full_state_dict(full)
    losses = _train(engine, "gpt", rank, dist.get_world_size(), 6, 2, first=2)
    return losses, engine.full_state_dict()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved,resumed", [((2, 3), (3, 1)), ((3, 2), (2, 3))])
def test_consolidated_checkpoint_reshards(tmp_path, saved, resumed):
    """Saved on P ranks with one stage, resumed on P' ranks with another: the losses and the
    final state are those of one uninterrupted process (global batch of 6 rows throughout)."""
    (P0, stage0), (P1, stage1) = saved, resumed
    path = str(tmp_path / "full.pt")
    first = distrain.spawn(_save_full, P0, args=(path, stage0), timeout=200)[0]
    rest, full = distrain.spawn(_resume_full, P1, args=(path, stage1), timeout=200)[0]
    ref_losses, ref_model, ref_opt = _reference(6, "gpt", "adamw")
    bad = _compare(f"{saved}->{resumed}", first + rest, ref_losses, full, ref_model, ref_opt)
    assert not bad, "\n".join(bad[:20])
    plain = _model("gpt", perturb=False)
    plain.load_state_dict(full["model"])  # the consolidated model loads into a plain module


def _sharded_roundtrip(rank: int, path: str) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    engine = Zero(_model("mlp"), _opt("adamw"), stage=3, algorithm="ring")
    first = _train(engine, "mlp", rank, P, 9, 2)
    torch.save(engine.state_dict(), f"{path}.{rank}")
    fresh = Zero(_model("mlp"), _opt("adamw"), stage=3, algorithm="ring")
    fresh.load_state_dict(torch.load(f"{path}.{rank}", weights_only=True))
    rest = _train(fresh, "mlp", rank, P, 9, 2, first=2)
    ref_losses, ref_model, ref_opt = _reference(9, "mlp", "adamw")
    bad = _compare("sharded", first + rest, ref_losses, fresh.full_state_dict(), ref_model, ref_opt)
    other = Zero(_model("mlp"), _opt("adamw"), stage=2, algorithm="ring")
    try:
        other.load_state_dict(torch.load(f"{path}.{rank}", weights_only=True))
        bad.append("no error loading a stage-3 shard into stage 2")
    except ConfigError as e:
        if "saved with stage 3 on 3 ranks" not in str(e) or "load_full_state_dict" not in str(e):
            bad.append(f"wrong error: {e}")
    return bad


@pytest.mark.timeout(200)
def test_sharded_checkpoint_roundtrip_and_layout_check(tmp_path):
    run_ranks(_sharded_roundtrip, 3, str(tmp_path / "shard"), timeout=150)


class _Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)
        self.b.weight.requires_grad_(False)


def _bad_args(rank: int) -> list[str]:
    errs = []
    cases = [
        (lambda: Zero(_model("mlp"), _opt("sgd"), stage=4), "stage must be 1, 2 or 3, got 4"),
        (lambda: Zero(_model("mlp"), _opt("sgd"), algorithm="mesh"), "unknown algorithm 'mesh'"),
        (lambda: Zero(_model("mlp"), _opt("sgd"), stage=2, units=[]), "units= applies to stage 3 only"),
        (lambda: Zero(_model("mlp"), _opt("sgd"), bucket_cap_mb=0), "bucket_cap_mb must be positive"),
        (lambda: Zero(_Frozen(), _opt("sgd"), stage=3), "['b.weight'] have requires_grad=False"),
        (lambda: Zero(_model("mlp"), _opt("sgd"), stage=3, units=[_model("mlp").layers[1]]), "are in no unit"),
        (lambda: Zero(_model("mlp"), lambda ps: torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1)),
         "must optimize exactly the parameters it is given"),
        (lambda: Zero(_model("mlp"), _opt("sgd")).clip_grad_norm_(0), "max_norm must be positive, got 0"),
        (lambda: Zero(_model("mlp"), _opt("sgd")).load_full_state_dict({"model": {}}), "not a consolidated"),
    ]
    for make, frag in cases:
        try:
            make()
            errs.append(f"no error for {frag!r}")
        except ConfigError as e:
            if frag not in str(e):
                errs.append(f"{frag!r} not in {e}")
    return errs


@pytest.mark.timeout(120)
def test_bad_arguments_are_refused_with_the_reason():
    run_ranks(_bad_args, 2, timeout=90)


def _memory(rank: int) -> list[tuple]:
    import torch.distributed as dist

    P = dist.get_world_size()
    out = []
    for stage in (1, 2, 3):
        engine = Zero(_model("gpt"), _opt("adamw"), stage=stage, algorithm="ring", bucket_cap_mb=0.05)
        _train(engine, "gpt", rank, P, P * LOCAL_B, 1, clip=None)
        x, y = _data(P * LOCAL_B, "gpt", 1)
        _loss("gpt", engine(x[:LOCAL_B]), y[:LOCAL_B]).backward()  # gradients present, as before a step
        S = sum(u.shard for u in engine.units)
        out.append((stage, engine.memory(), S, len(engine.units), sum(u.numel for u in engine.units)))
    return out


@pytest.mark.timeout(200)
def test_memory_per_rank_is_exactly_the_sharded_layout():
    for r in distrain.spawn(_memory, 3, timeout=150):
        for stage, mem, S, units, psi in r:
            assert psi == 67_776  # gpt-tiny
            e = 8  # fp64
            assert mem["params"] == e * (3 * S if stage < 3 else S), (stage, mem)  # stage 3: 1/P, padding included
            assert mem["grads"] == e * (psi + S if stage == 1 else S), (stage, mem)  # stage 1 keeps full-size grads
            # AdamW: exp_avg and exp_avg_sq per shard element, and one fp32 step counter per shard
            assert mem["optimizer"] == 2 * e * S + 4 * units, (stage, mem)
            assert 3 * S - psi < 3 * units  # padding: fewer than P elements per unit
