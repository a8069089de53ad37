"""dp x tp x pp composition (parallelize) equals one process on the same global batch (fp64)."""

from __future__ import annotations

import pytest
import torch

from distrain import Topology
from distrain.models import build_model, lm_loss
from distrain.parallel.parallelize import parallelize
from distrain.parallel.tensor_parallel import tp_shard_info
from distrain.models.gpt.plan import gpt_tp_plan

from conftest import run_ranks

STEPS = 3
GLOBAL_B = 8


def _batch(step: int):
    g = torch.Generator().manual_seed(500 + step)
    ids = torch.randint(0, 256, (GLOBAL_B, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _reference():
    torch.manual_seed(0)
    m = build_model("gpt-tiny").double()
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    losses, grads = [], []
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = lm_loss(m(x), y)
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, grads, dict(m.named_parameters())


def _composed(rank: int, dp: int, tp: int, pp: int, schedule: str, alg: str) -> list[str]:
    ref_losses, ref_grads, ref_params = _reference()
    topo = Topology.from_world(dp=dp, tp=tp, pp=pp)
    torch.manual_seed(0)
    pm = parallelize(build_model("gpt-tiny").double(), topo, loss_fn=lm_loss, tp_plan=gpt_tp_plan(), algorithm=alg,
                     microbatches=2, schedule=schedule)
    opt = torch.optim.Adam(pm.parameters(), lr=1e-2)
    start = pm.stage.start if pm.stage is not None else 0  # the stage's first layer in the full model

    def full_name(n: str) -> str:  # stage "layers.i.x" -> model "layers.{start+i}.x"
        head, i, rest = n.split(".", 2)
        return f"{head}.{int(i) + start}.{rest}"

    info = tp_shard_info(pm.module)
    local = GLOBAL_B // dp
    bad = []
    for s in range(STEPS):
        x, y = _batch(s)
        mine = slice(topo.dp_rank * local, (topo.dp_rank + 1) * local)
        opt.zero_grad()
        loss = pm.train_step(x[mine], y[mine])
        if pm.has_loss:  # mean over dp replicas = the global batch's loss
            g = loss.clone()
            torch.distributed.all_reduce(g, group=topo.dp_group)
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
    return [f"rank {rank} (dp,tp,pp)=({dp},{tp},{pp}) {schedule} {alg}: {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dp,tp,pp,schedule,alg", [
    (2, 2, 1, "1f1b", "ring"),
    (2, 1, 2, "1f1b", "tree"),
    (2, 1, 2, "gpipe", "native"),
    (1, 2, 2, "1f1b", "native"),
    (1, 2, 2, "gpipe", "ring"),
    (2, 1, 2, "zb-h1", "ring"),    # zero bubble: DDP all-reduces after the deferred W passes
    (1, 2, 2, "zb-h1", "native"),  # zero bubble: the split linears sit between TP's f and g
])
def test_composition_equals_single_process(dp, tp, pp, schedule, alg):
    run_ranks(_composed, dp * tp * pp, dp, tp, pp, schedule, alg, timeout=200)
