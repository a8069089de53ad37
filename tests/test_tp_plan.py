"""Tensor-parallel plans on models that are not the GPT: a user-defined residual transformer-style
network with its own module names, and distrain's MLP with its plan. TP (tp=2) alone and
parallelize() (tp, dp x tp, tp x pp) equal one process in fp64 over several optimizer steps;
plan errors are clear and raised before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from distrain import Topology, comm
from distrain.errors import ConfigError
from distrain.models import MLP, classification_loss
from distrain.models.mlp.plan import mlp_tp_plan
from distrain.parallel import parallelize
from distrain.parallel.tensor_parallel import (
    ColwiseParallel, ColumnParallelLinear, RowParallelLinear, TPPlan, apply_tensor_parallel, tp_shard_info,
)

from conftest import run_ranks

STEPS = 3
B, T, D, C, H, K = 8, 5, 5, 12, 20, 8  # batch, tokens, input width, model width, hidden width, outputs


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(C, H)
        self.down = nn.Linear(H, C)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        return self.down(torch.tanh(self.up(x)))


class Mixer(nn.Module):
    """A pre-norm residual block of the user's own design (names unlike the GPT's)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(C)
        self.ffn = FeedForward()

    def forward(self, x):
        return x + self.ffn(self.norm(x))


class UserNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(D, C), Mixer(), Mixer(), Mixer(), nn.Linear(C, K)])

    def forward(self, x):  # (B, T, D) -> (B, T, K)
        for layer in self.layers:
            x = layer(x)
        return x


USER_PLAN = TPPlan({"ffn.up": "colwise", "ffn.down": "rowwise", "layers.4": ColwiseParallel(gather_output=True)})


def _mse(out, y):
    return F.mse_loss(out, y)


def _user_batch(step: int):
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(B, T, D, generator=g, dtype=torch.float64), torch.randn(B, T, K, generator=g,
                                                                            dtype=torch.float64)


def _mlp_batch(step: int):
    g = torch.Generator().manual_seed(90 + step)
    return torch.randn(B, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 5, (B,), generator=g)


CASES = {
    "user": (lambda: UserNet(), lambda m: USER_PLAN, _mse, _user_batch),
    "mlp": (lambda: MLP(12, (16, 8, 6), 5), mlp_tp_plan, classification_loss, _mlp_batch),
}


def _build(case: str) -> nn.Module:
    torch.manual_seed(0)
    return CASES[case][0]().double()


def _reference(case: str):
    _, _, loss_fn, batch = CASES[case]
    m = _build(case)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, grads = [], []
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        loss = loss_fn(m(x), y)
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
    return losses, grads, {n: p.detach().clone() for n, p in m.named_parameters()}


def _run(rank: int, case: str, dp: int, tp: int, pp: int) -> list[str]:
    _, plan_of, loss_fn, batch = CASES[case]
    ref_losses, ref_grads, ref_params = _reference(case)
    topo = Topology.from_world(dp=dp, tp=tp, pp=pp)
    model = _build(case)
    pm = parallelize(model, topo, loss_fn=loss_fn, tp_plan=plan_of(model), algorithm="ring", microbatches=2)
    n_split = sum(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in pm.module.modules())
    bad = [] if n_split else ["no module was split"]
    start = pm.stage.start if pm.stage is not None else 0

    def full_name(n: str) -> str:  # stage "layers.i.x" -> model "layers.{start+i}.x"
        head, i, rest = n.split(".", 2)
        return f"{head}.{int(i) + start}.{rest}"

    info = tp_shard_info(pm.module)
    opt = torch.optim.Adam(pm.parameters(), lr=1e-2)
    local = B // dp
    for s in range(STEPS):
        x, y = batch(s)
        mine = slice(topo.dp_rank * local, (topo.dp_rank + 1) * local)
        opt.zero_grad()
        loss = pm.train_step(x[mine], y[mine])
        if pm.has_loss:
            g = loss.clone()
            dist.all_reduce(g, group=topo.dp_group)
            if abs(g.item() / dp - ref_losses[s]) > 1e-10:
                bad.append(f"step {s}: loss {g.item() / dp!r} != {ref_losses[s]!r}")
        for n, p in pm.module.named_parameters():
            want = info[n].take(ref_grads[s][full_name(n)])
            if not torch.allclose(p.grad, want, rtol=1e-9, atol=1e-12):
                bad.append(f"step {s} grad {n}: max diff {(p.grad - want).abs().max().item():.2e}")
        opt.step()
    for n, p in pm.module.named_parameters():
        want = info[n].take(ref_params[full_name(n)])
        if not torch.allclose(p, want, rtol=1e-9, atol=1e-12):
            bad.append(f"param {n} after {STEPS} steps: max diff {(p - want).abs().max().item():.2e}")
    return [f"rank {rank} {case} (dp,tp,pp)=({dp},{tp},{pp}): {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case,dp,tp,pp", [
    ("user", 1, 2, 1),
    ("mlp", 1, 2, 1),
    ("user", 2, 2, 1),
    ("user", 1, 2, 2),
])
def test_plan_on_a_model_that_is_not_the_gpt_equals_one_process(case, dp, tp, pp):
    run_ranks(_run, dp * tp * pp, case, dp, tp, pp, timeout=200)


def test_mlp_plan_pairs_linears_column_then_row():
    plan = mlp_tp_plan(MLP(12, (16, 8, 6), 5))  # Linear at layers 1, 3, 5, 7
    assert plan.styles == {"layers.1": ColwiseParallel(), "layers.3": plan.styles["layers.3"],
                           "layers.5": ColwiseParallel(), "layers.7": plan.styles["layers.7"]}
    assert type(plan.styles["layers.3"]).__name__ == "RowwiseParallel"
    odd = mlp_tp_plan(MLP(12, (16, 8), 5))  # three Linears: the last one gathered
    assert odd.styles["layers.5"] == ColwiseParallel(gather_output=True)


@pytest.mark.parametrize("plan, msg", [
    ({"ffn.up": "diagonal"}, "TPPlan: 'ffn.up' has unknown style 'diagonal'; use one of colwise, rowwise, vocab"),
    ({}, "TPPlan: layers must be a non-empty mapping"),
])
def test_plan_errors_without_a_group(plan, msg):
    with pytest.raises(ConfigError, match=msg):
        TPPlan(plan)


def _plan_errors(rank: int) -> list[str]:
    cases = [
        ({"ffn": "colwise"}, "layers.1.ffn is a FeedForward, but its style ColwiseParallel needs an nn.Linear"),
        ({"norm": "rowwise"}, "layers.1.norm is a LayerNorm, but its style RowwiseParallel needs an nn.Linear"),
        ({"layers.0": "rowwise"}, "layers.0.in_features=5 is not divisible by tp=2; choose tp among the "
                                  "divisors of 5: 1, 5"),
        ({"attn.q_proj": "colwise"}, "the plan's keys ['attn.q_proj'] match no module of UserNet"),
        ({"ffn.*": "colwise", "up": "colwise"}, "module layers.1.ffn.up matches several plan keys"),
    ]
    bad = []
    with comm.ledger() as led:
        for plan, msg in cases:
            model = _build("user")
            before = {k: v.clone() for k, v in model.state_dict().items()}
            try:
                apply_tensor_parallel(model, None, "ring", plan=plan)
                bad.append(f"rank {rank}: {plan}: no error")
            except ConfigError as e:
                if msg not in str(e):
                    bad.append(f"rank {rank}: {plan}: message {e}")
            after = model.state_dict()
            if before.keys() != after.keys() or any(not torch.equal(before[k], after[k]) for k in before):
                bad.append(f"rank {rank}: {plan}: the model was modified before the error")
    if led.total().calls:
        bad.append(f"rank {rank}: collectives ran before the errors: {led.as_dict()}")
    return bad


@pytest.mark.timeout(60)
def test_plan_errors_before_any_change_or_collective():
    run_ranks(_plan_errors, 2, timeout=45)


def test_parallelize_needs_a_plan_for_tp():
    topo = Topology(dp=1, tp=2, pp=1, rank=0)
    with pytest.raises(ConfigError, match=r"parallelize: tp=2 needs tp_plan= \(module name -> 'colwise'"):
        parallelize(_build("user"), topo, loss_fn=_mse)
    with pytest.raises(ConfigError, match="parallelize: loss_fn must be a callable"):
        parallelize(_build("user"), topo, loss_fn=None, tp_plan=USER_PLAN)
