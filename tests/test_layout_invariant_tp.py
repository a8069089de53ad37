"""--layout-invariant with tensor parallelism: --tp 2 and 4 (and dp x tp) give one process's bits.

Every reduction tensor parallelism splits (row-parallel outputs, column-parallel input gradients, the
vocab-parallel loss's sum of exp) is computed as C fixed chunks added in one fixed tree, in every layout,
one process included (distrain.parallel.tensor_parallel.invariant). The unit tests check the chunked
Functions against the tree written out by hand, and on 2 and 4 ranks against one process; the matrix trains
gpt-tiny and llama-tiny in float32 and compares every step's loss (==) and the consolidated final state
(torch.equal) with the one-process run. No tolerance anywhere but in the sanity checks against the plain
(unchunked) formulas, which say what is computed, not how its bits fall.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from conftest import consolidated_state, invariant_matrix, run_ranks, state_differences, train_losses, trainer_config
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel import (
    ColumnParallelLinear, ColwiseParallel, RowParallelLinear, TPPlan, apply_tensor_parallel, tp_shard_info,
    vocab_parallel_cross_entropy,
)
from distrain.parallel.tensor_parallel.group import TPGroup
from distrain.parallel.tensor_parallel.invariant import tree_sum

C = 4  # the canonical chunks


# -- the tree ---------------------------------------------------------------------------------------------
def test_tree_sum_adds_pairs_then_pairs_of_pairs():
    p = [torch.tensor([1e8], dtype=torch.float32), torch.tensor([1.0]), torch.tensor([-1e8]), torch.tensor([1.0])]
    assert tree_sum(p).item() == 0.0                     # (1e8 + 1) + (-1e8 + 1) = 1e8 - 1e8 in float32
    assert (((p[0] + p[1]) + p[2]) + p[3]).item() == 1.0  # the left-to-right sum rounds elsewhere
    with pytest.raises(ConfigError):
        tree_sum(p[:3])


# -- the layers on one process: the tree written out --------------------------------------------------------
def _alone():
    return TPGroup.alone(chunks=C)


def test_one_process_row_parallel_is_the_chunk_tree_forward_and_backward():
    torch.manual_seed(0)
    lin = nn.Linear(32, 24)
    row = RowParallelLinear.from_linear(lin, _alone())
    x = torch.randn(3, 5, 32, requires_grad=True)
    y = row(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    xs, ws = x.detach().split(8, dim=-1), lin.weight.detach().split(8, dim=1)
    parts = [F.linear(a.contiguous(), w.contiguous()) for a, w in zip(xs, ws)]
    assert torch.equal(y, ((parts[0] + parts[1]) + (parts[2] + parts[3])) + lin.bias)
    assert torch.equal(x.grad, torch.cat([dy @ w.contiguous() for w in ws], dim=-1))
    assert torch.allclose(y, lin(x), atol=1e-5)  # what it computes: the linear layer


def test_one_process_column_parallel_input_gradient_is_the_chunk_tree():
    torch.manual_seed(0)
    lin = nn.Linear(16, 32)
    col = ColumnParallelLinear.from_linear(lin, _alone())
    x = torch.randn(3, 5, 16, requires_grad=True)
    y = col(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    ws, bs = lin.weight.detach().split(8), lin.bias.detach().split(8)
    assert torch.equal(y, torch.cat([F.linear(x.detach(), w, b) for w, b in zip(ws, bs)], dim=-1))
    d = [dc @ w for dc, w in zip(dy.split(8, dim=-1), ws)]
    assert torch.equal(x.grad, (d[0] + d[1]) + (d[2] + d[3]))
    assert torch.allclose(x.grad, dy @ lin.weight.detach(), atol=1e-5)


def test_one_process_vocab_loss_sums_exp_in_the_chunk_tree():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 64, requires_grad=True)
    t = torch.randint(0, 64, (2, 6))
    t[0, 1] = -100
    loss = vocab_parallel_cross_entropy(logits, t, _alone())
    loss.backward()
    x = logits.detach().reshape(-1, 64)
    x = x - x.max(dim=-1).values.unsqueeze(-1)
    s = [c.contiguous().exp().sum(dim=-1) for c in x.split(16, dim=1)]
    s = (s[0] + s[1]) + (s[2] + s[3])
    tt = t.reshape(-1)
    valid = tt != -100
    picked = x.gather(1, tt.clamp(min=0).unsqueeze(1)).squeeze(1) * valid
    want = ((s.log() - picked) * valid).sum() / int(valid.sum())
    assert torch.equal(loss.detach(), want)
    ref = logits.detach().clone().requires_grad_()
    F.cross_entropy(ref.reshape(-1, 64), tt).backward()
    assert torch.allclose(loss, F.cross_entropy(logits.detach().reshape(-1, 64), tt), atol=1e-6)
    assert torch.allclose(logits.grad, ref.grad, atol=1e-7)


# -- the layers split over 2 and 4 ranks equal one process -----------------------------------------------------
class _Mix(nn.Module):
    """Three column-parallel linears reading one input (q, k, v): their input gradients meet per chunk."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(16, 32)

    def forward(self, x):
        return torch.tanh(self.q(x)) * self.k(x) + self.v(x)


class _Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.mix = _Mix()
        self.out = nn.Linear(32, 16)
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.out(self.mix(h))
        return self.head(h)


heads = ColwiseParallel(sync_input=False)
TOY_PLAN = TPPlan({"emb": "vocab", "mix": "copy_input", "mix.q": heads, "mix.k": heads, "mix.v": heads,
                   "out": "rowwise", "head": "colwise"}, loss=vocab_parallel_cross_entropy)


def _toy_run(tp: TPGroup):
    torch.manual_seed(0)
    m = apply_tensor_parallel(_Toy(), tp, plan=TOY_PLAN)
    g = torch.Generator().manual_seed(1)
    ids, t = torch.randint(0, 64, (2, 8), generator=g), torch.randint(0, 64, (2, 8), generator=g)
    loss = TOY_PLAN.loss(m(ids), t, tp)
    loss.backward()
    return loss.detach(), m


def _split_equals_one_process(rank: int) -> list[str]:
    torch.set_num_threads(1)
    want, whole = _toy_run(TPGroup.alone(chunks=C))
    got, mine = _toy_run(TPGroup(None, "native", chunks=C))
    problems = [] if torch.equal(got, want) else [f"loss {got.item()!r} != {want.item()!r}"]
    full = dict(whole.named_parameters())
    for name, info in tp_shard_info(mine).items():
        p = dict(mine.named_parameters())[name]
        if not torch.equal(p.grad, info.take(full[name].grad)):
            problems.append(f"{name}: gradient differs by {(p.grad - info.take(full[name].grad)).abs().max().item()}")
    if dist.get_world_size() == 1:
        problems.append("not split")
    return problems


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 4])
def test_split_over_ranks_equals_one_process_bit_for_bit(P):
    run_ranks(_split_equals_one_process, P, timeout=100)


# -- what is refused ------------------------------------------------------------------------------------------
def test_chunks_refuse_sequence_parallelism_and_an_unordered_copy_input():
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match="does not cover sequence parallelism"):
        RowParallelLinear.from_linear(nn.Linear(8, 8), _alone(), sequence_parallel=True)(torch.randn(1, 4, 8))

    class Reads(nn.Module):  # uses its input outside a column-parallel linear: its gradient sum has no order
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return F.linear(x, self.lin.weight)

    m = apply_tensor_parallel(nn.Sequential(Reads()), _alone(), plan=TPPlan({"0": "copy_input"}))
    with pytest.raises(ConfigError, match="used its input without a column-parallel linear"):
        m(torch.randn(2, 8, requires_grad=True))
    with pytest.raises(ConfigError, match="cannot be shared by tp=1"):
        TPGroup.alone(chunks=3)


@pytest.mark.parametrize("kw, message", [
    (dict(tp=3, nproc=3), "--layout-invariant computes tensor-parallel sums as 4 fixed chunks, which --tp 3 cannot "
                          "share; use --tp 1, 2, 4"),
    (dict(tp=2, nproc=2, strategy="zero2"), "--layout-invariant with --tp 2 covers --strategy ddp"),
    (dict(tp=2, pp=2, nproc=4), "--layout-invariant with --tp 2 covers --strategy ddp without --pp"),
    (dict(cp=2, nproc=2), "--layout-invariant covers data, tensor and pipeline parallelism today, not --cp 2:"),
    (dict(tp=2, nproc=2, invariant_tp=False), "--layout-invariant with --tp 2 needs --invariant-tp"),
])
def test_what_it_cannot_do_with_tp_is_refused_in_one_line(tmp_path, kw, message):
    with pytest.raises(ConfigError) as e:
        _job(tmp_path / "run", **{"strategy": "ddp", **kw}).validate()
    assert str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


# -- the matrix: the trainer, float32, 10 steps ------------------------------------------------------------------
# 10 steps, each compared (==) with one process, and the final state (torch.equal): a layout whose sums fell in
# another order differs from the first step on (the clip, 0.5, acts at every step). An invariant step costs
# ~1 s per rank here, so 30 steps made the three suite layouts ~2 minutes of `make test`.
STEPS = 10


def _job(out, **kw):
    base = dict(dtype="float32", layout_invariant=True, invariant_tp=True, units=8, batch_size=8, steps=STEPS,
                grad_clip=0.5, log_every=10)
    return trainer_config(out, **{**base, **kw})


_REFERENCES: dict = {}


def _reference(tmp_path_factory, model: str):
    if model not in _REFERENCES:
        out = tmp_path_factory.mktemp("tp-invariant-reference")
        _REFERENCES[model] = (train_losses(_job(out, model=model, strategy="single", nproc=1)), consolidated_state(out))
    return _REFERENCES[model]


MATRIX = {
    "gpt-tiny-tp2": dict(model="gpt-tiny", tp=2, nproc=2),
    "gpt-tiny-tp4": dict(model="gpt-tiny", tp=4, nproc=4),
    "gpt-tiny-dp2-tp2": dict(model="gpt-tiny", tp=2, nproc=4),
    "llama-tiny-tp2": dict(model="llama-tiny", tp=2, nproc=2),
    "llama-tiny-dp2-tp2": dict(model="llama-tiny", tp=2, nproc=4),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", invariant_matrix(MATRIX, ["gpt-tiny-tp2", "gpt-tiny-tp4", "llama-tiny-dp2-tp2"]))
def test_tensor_parallel_layouts_are_one_process_bit_for_bit(tmp_path, tmp_path_factory, name):
    kw = MATRIX[name]
    want_losses, want_state = _reference(tmp_path_factory, kw["model"])
    out = tmp_path / "run"
    losses = train_losses(_job(out, strategy="ddp", **kw))
    assert len(losses) == len(want_losses) == STEPS
    wrong = [(i, a, b) for i, (a, b) in enumerate(zip(losses, want_losses)) if a != b]
    assert not wrong, f"{len(wrong)} step losses differ, first {wrong[:3]}"
    assert state_differences(consolidated_state(out), want_state) == []
