"""parallel/clip.py: the one global-norm clip every engine uses (the layouts' equivalence tests run it
across ranks; these pin down its arithmetic on one process), and the group ZeRO's clip sums over (2 ranks)."""

from __future__ import annotations

import pytest
import torch

from distrain.errors import ConfigError
from distrain.parallel.clip import clip_grad_norm


def _grads(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)]


def test_equals_torch_clip_grad_norm_on_one_process():
    ours, theirs = _grads(), _grads()
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in theirs]
    for p, t in zip(params, theirs):
        p.grad = t
    want = float(torch.nn.utils.clip_grad_norm_(params, 0.5))
    assert clip_grad_norm([(g, 1) for g in ours], 0.5) == pytest.approx(want, rel=1e-15)
    for a, p in zip(ours, params):
        torch.testing.assert_close(a, p.grad, rtol=1e-15, atol=0)
    assert torch.linalg.vector_norm(torch.cat([g.flatten() for g in ours])).item() == pytest.approx(0.5, rel=1e-6)


def test_weights_count_terms_and_every_term_is_scaled():
    g1, g2 = _grads()
    n1 = torch.linalg.vector_norm(g1).item()
    a, b = g1.clone(), g2.clone()
    # g2 counted by another rank (weight 0): the norm is g1's alone, yet g2 is scaled by the same factor
    assert clip_grad_norm([(a, 1), (b, 0)], n1 / 4) == pytest.approx(n1, rel=1e-15)
    scale = (n1 / 4) / (n1 + 1e-6)
    assert torch.equal(a, g1 * scale) and torch.equal(b, g2 * scale)
    # weight 3 (an expert held by a third of the replicas), a 0/1 mask (ZeRO's shard of a count mask)
    mask = torch.zeros(7, dtype=torch.float64)
    mask[:2] = 1
    want = (3 * g1.pow(2).sum() + g2[:2].pow(2).sum()).sqrt().item()
    assert clip_grad_norm([(g1.clone(), 3), (g2.clone(), mask)], 1e9) == pytest.approx(want, rel=1e-15)
    assert clip_grad_norm([(None, 1), (g1.clone(), 1)], 1e9) == pytest.approx(n1, rel=1e-15)  # a None: no term


def test_under_the_limit_nothing_changes_and_a_bad_limit_is_refused():
    g = _grads()
    before = [t.clone() for t in g]
    clip_grad_norm([(t, 1) for t in g], 1e9)
    assert all(torch.equal(a, b) for a, b in zip(g, before))
    with pytest.raises(ConfigError, match=r"clip_grad_norm: max_norm must be positive, got 0"):
        clip_grad_norm([(t, 1) for t in g], 0)


def _zero_groups(rank: int) -> list[str]:
    """Each rank's Zero over a group of its own (its shards are its whole model, its gradients its own): the clip's
    norm is this rank's alone by default, both ranks' with group None (the world) or a group of both."""
    import torch.distributed as dist

    from distrain import comm
    from distrain.parallel.zero import Zero

    alone = [dist.new_group([r]) for r in range(2)][rank]
    both = dist.new_group([0, 1])
    bad = []
    for stage in (1, 3):
        torch.manual_seed(0)
        engine = Zero(torch.nn.Linear(4, 3, dtype=torch.float64), lambda ps: torch.optim.SGD(ps, lr=0.1),
                      stage=stage, group=alone)
        engine(torch.full((2, 4), rank + 1.0, dtype=torch.float64)).pow(2).sum().backward()
        own = sum(s.grad.pow(2).sum() for s in engine.parameters())
        world = own.clone()
        comm.all_reduce(world)
        for name, kw, want in (("left out", {}, own), ("None", dict(group=None), world),
                               ("both", dict(group=both), world), ("alone", dict(group=alone), own)):
            got = engine.clip_grad_norm_(1e9, **kw)  # (no scaling: the gradients stay as they are)
            if got != pytest.approx(want.sqrt().item(), rel=1e-15):
                bad.append(f"stage {stage} group {name}: norm {got} != {want.sqrt().item()}")
        if own == world:
            bad.append("the ranks' gradients do not differ: the test would not tell the groups apart")
    return bad


@pytest.mark.timeout(60)
def test_zeros_clip_sums_over_its_group_by_default_and_over_the_group_given():
    from conftest import run_ranks

    run_ranks(_zero_groups, 2, timeout=50)
