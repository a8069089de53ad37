"""Interleaved 1F1B (Narayanan et al. 2021): the schedule cannot deadlock, its simulated bubble is
(p-1)/(v*m) exactly, and the executor equals one process in fp64 over several optimizer steps."""

from __future__ import annotations

import pytest
import torch

from distrain import Topology
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.parallel.pipeline_parallel import (
    InterleavedStage, interleaved_bubble, interleaved_ops, interleaved_step, simulate_interleaved,
)

from conftest import one_process_losses, run_ranks

B, T, STEPS = 12, 8, 3


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_simulated_bubble_is_p_minus_1_over_v_m(p, v, mult):
    m = mult * p
    tl = simulate_interleaved(p, v, m)  # raises ScheduleDeadlock if any rank could block forever
    compute = tl.compute_time()
    assert (p * tl.makespan() - compute) / compute == pytest.approx(interleaved_bubble(p, v, m), abs=1e-12)
    for r in range(p):  # every (chunk, micro-batch) forward once, backward once, forward first
        ops = interleaved_ops(p, r, v, m)
        fwd = [(c, k) for kind, c, k in ops if kind == "F"]
        bwd = [(c, k) for kind, c, k in ops if kind == "B"]
        assert sorted(fwd) == sorted(bwd) == [(c, k) for c in range(v) for k in range(m)]
        assert all(ops.index(("F",) + x) < ops.index(("B",) + x) for x in bwd)


def test_interleaved_needs_m_multiple_of_p():
    with pytest.raises(ConfigError, match=r"num_microbatches=3 must be a multiple of the pipeline size p=2"):
        interleaved_ops(2, 0, 2, 3)


def _reference():
    torch.manual_seed(0)
    m = build_model("gpt-tiny").double()
    return one_process_losses(m, torch.optim.Adam(m.parameters(), lr=1e-2), lm_loss, map(_batch, range(STEPS))), m


def _batch(step: int):
    g = torch.Generator().manual_seed(4000 + step)
    ids = torch.randint(0, 256, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _interleaved(rank: int, v: int, m: int) -> list[str]:
    ref_losses, ref = _reference()
    topo = Topology.from_world(pp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    stage = InterleavedStage.from_topology(build_model("gpt-tiny").double(), topo, v, balance=[1] * 6)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    bad = []
    last = topo.pp_rank == topo.pp - 1
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = interleaved_step(stage, x if topo.pp_rank == 0 else None, y if last else None,
                                lm_loss if last else None, num_microbatches=m)
        if last and abs(loss.item() - ref_losses[s]) > 1e-12:
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
        opt.step()
    for c, (a, b) in enumerate(stage.bounds):
        for (n, p), q in zip(stage.chunks[c].named_parameters(),
                             torch.nn.Sequential(*ref.layers[a:b]).parameters()):
            if not torch.allclose(p, q, rtol=1e-9, atol=1e-12):
                bad.append(f"chunk {c} (layers {a}:{b}) {n}: max diff {(p - q).abs().max().item():.2e}")
    return [f"rank {rank} p={topo.pp} v={v} m={m}: {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p,v,m", [(2, 3, 2), (2, 3, 4), (3, 2, 6)])
def test_interleaved_equals_one_process(p, v, m):
    run_ranks(_interleaved, p, v, m, timeout=200)
