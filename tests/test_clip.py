"""parallel/clip.py: the one global-norm clip every engine uses (the layouts' equivalence tests run it
across ranks; these pin down its arithmetic on one process)."""

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
