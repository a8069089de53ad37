"""Vocab-parallel cross entropy (Megatron-LM): the loss of logits sharded along the vocabulary,
without gathering them. Shapes: N = tokens, V vocabulary, P = tp size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.group import as_tp_group
from distrain.parallel.tensor_parallel.invariant import combine, local_chunks, tree_sum


def _exp_sum(x: torch.Tensor, tp) -> tuple[torch.Tensor, torch.Tensor]:
    """exp of the shifted shard (N, V/P) and its sum over the whole vocabulary (N,): one SUM all-reduce."""
    e = x.exp()                                                      # (N, V/P)
    s = e.sum(dim=-1)                                                # (N,) local sum of exp
    comm.all_reduce(s, group=tp.group, algorithm=tp.algorithm)       # (N,) global sum of exp
    return e, s


def _exp_sum_canonical(x: torch.Tensor, tp) -> tuple[torch.Tensor, torch.Tensor]:
    """The same, the sum in the canonical tree of the group's C chunks (--layout-invariant: the same bits on
    any tp size, one process included): exp on each chunk's contiguous (N, V/C) block, the same shape in every
    layout."""
    es = [c.contiguous().exp() for c in x.split(x.shape[-1] // local_chunks(tp), dim=1)]  # C/P x (N, V/C)
    return torch.cat(es, dim=1), combine(tree_sum([e.sum(dim=-1) for e in es]), tp)


class _VocabParallelCE(torch.autograd.Function):
    """Mean cross entropy over the non-ignored tokens, from logits sharded on the vocab.

    Three all-reduces of N elements (N = tokens): MAX of the local max, SUM of the target
    logit (non-zero only on the rank owning the target), SUM of the local sum of exp (``exp_sum``:
    ``_exp_sum``, or with --layout-invariant ``_exp_sum_canonical``). The maximum and the target logit (one
    rank's value, zeros elsewhere) are exact in any layout; the backward is elementwise.
    """

    @staticmethod
    def forward(ctx, logits, targets, tp, ignore_index, exp_sum):
        Vp = logits.shape[-1]
        x = logits.reshape(-1, Vp)                                   # (N, V/P)
        t = targets.reshape(-1)                                      # (N,)
        start = tp.rank * Vp
        valid = t != ignore_index                                    # (N,)
        n_valid = int(valid.sum())
        full_v = Vp * tp.size
        tv = t[valid]
        if tv.numel() and (int(tv.min()) < 0 or int(tv.max()) >= full_v):  # same on every rank: no collective yet
            lo, hi = int(tv.min()), int(tv.max())
            raise ConfigError(f"vocab_parallel_cross_entropy: targets must lie in [0, {full_v}) "
                              f"(or equal ignore_index={ignore_index}); got values in [{lo}, {hi}]")

        m = x.max(dim=-1).values                                     # (N,) local max
        if tp.size > 1:
            comm.all_reduce(m, op="max", group=tp.group, algorithm=tp.algorithm)   # (N,) global max
        x = x - m.unsqueeze(-1)                                      # (N, V/P), <= 0

        mine = valid & (t >= start) & (t < start + Vp)               # (N,) targets this rank owns
        local_t = torch.where(mine, t - start, torch.zeros_like(t))  # (N,) in [0, V/P)
        picked = x.gather(1, local_t.unsqueeze(1)).squeeze(1) * mine  # (N,) target logit or 0
        if tp.size > 1:
            comm.all_reduce(picked, group=tp.group, algorithm=tp.algorithm)     # (N,) target logit

        e, s = exp_sum(x, tp)                                        # (N, V/P), (N,)

        per_token = (s.log() - picked) * valid                       # (N,) -log softmax[target]
        loss = per_token.sum() / n_valid if n_valid else per_token.sum() * float("nan")
        e.div_(s.unsqueeze(-1))                                      # (N, V/P) softmax shard
        ctx.save_for_backward(e, local_t, mine, valid)
        ctx.shape = logits.shape
        ctx.n_valid = n_valid
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_t, mine, valid = ctx.saved_tensors
        g = softmax.clone()                                          # d loss_i / d x_i = softmax - onehot
        g[torch.arange(g.shape[0], device=g.device), local_t] -= mine.to(g.dtype)
        scale = grad_loss / max(ctx.n_valid, 1)
        g.mul_((valid.to(g.dtype) * scale).unsqueeze(-1))            # mean over valid tokens, ignored ones 0
        return g.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, targets: torch.Tensor, group=None,
                                 algorithm: str = "native", ignore_index: int = -100) -> torch.Tensor:
    """Mean cross entropy of ``logits_shard`` (..., V/P), this rank's slice [r*V/P, (r+1)*V/P)
    of the vocabulary, against the full ``targets`` (...): equals ``F.cross_entropy`` on the
    gathered logits (``lm_loss``), without ever gathering them. The result is the same scalar on
    every rank of the group. Backward: (softmax shard - one-hot shard) / tokens, no collective.
    A group with ``chunks`` (--layout-invariant) sums the exponentials in its canonical chunk tree, on
    one process too (the same bits on every tp size dividing the chunks).
    """
    tp = as_tp_group(group, algorithm)
    if logits_shard.shape[:-1] != targets.shape:
        raise ConfigError(f"vocab_parallel_cross_entropy: logits shard {tuple(logits_shard.shape)} and targets "
                          f"{tuple(targets.shape)} disagree; logits must be targets' shape plus the vocab dim")
    if tp.chunks:
        return _VocabParallelCE.apply(logits_shard, targets, tp, ignore_index, _exp_sum_canonical)
    if tp.size == 1:
        return F.cross_entropy(logits_shard.reshape(-1, logits_shard.shape[-1]), targets.reshape(-1),
                               ignore_index=ignore_index)
    return _VocabParallelCE.apply(logits_shard, targets, tp, ignore_index, _exp_sum)
