"""Token dispatch and combine across the ep ranks: two all-to-alls with uneven splits per MoE layer.

GShard (Lepikhin et al. 2020) and Switch (Fedus et al. 2021) place E/ep experts on each of the ep
ranks of an expert-parallel group; every rank routes its own tokens, then (DeepSpeed-MoE, Megatron-
Core's "alltoall" token dispatcher, torchtitan's ``ExpertParallel``)::

    slots (N*k) kept by the router, sorted by expert          -> M rows, expert-major
    counts (E,) -> the (ep, E/ep) counts exchanged            (every rank learns what it receives)
    dispatch: x[slot's token] (M, C) -a2a-> (R, C)            rows grouped by source rank, then expert
    regroup by local expert, run each expert on its rows      (R, C)
    combine:  (R, C) -a2a-> (M, C), back in the sender's order
    y[t] += w[slot] * row, over the token's slots             (N, C)

The splits are uneven (each rank sends what its router chose), so every message's size comes from the
count exchange; no padding and nothing dropped (capacity is the router's business, before this).
Backward is the same two all-to-alls mirrored (autograd: :class:`_Exchange`). With capacity
unlimited the result is the one-process layer's exactly (every token meets the same experts with the
same weights; only the order of sums differs).

Every all-to-all is ``distrain.comm.all_to_all_single(algorithm="p2p")`` (one message to each other rank of
the group with a non-empty block: a direct exchange), so the ledger counts them: label ``ep-all-to-all`` for
the tokens, ``ep-counts`` for the count exchange. :func:`ep_bytes` is the formula from the routing
matrix, checked byte for byte in tests/test_moe.py.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError

__all__ = ["COUNTS_LABEL", "LABEL", "ExpertParallel", "ep_bytes"]

LABEL = "ep-all-to-all"
COUNTS_LABEL = "ep-counts"


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], ep: "ExpertParallel",
                label: str = LABEL) -> torch.Tensor:
    """x (sum(send), ...): rows send[p] to rank p -> (sum(recv), ...), blocks in source-rank order (empty
    blocks are not sent). One rank (no group): x itself, copied."""
    if ep.group is None:
        return x.clone()
    out = x.new_empty(sum(recv), *x.shape[1:])
    comm.all_to_all_single(out, x, recv, send, group=ep.group, algorithm="p2p", label=label)
    return out


class _Exchange(torch.autograd.Function):
    """The all-to-all with autograd: backward sends the gradients back along the same rows."""

    @staticmethod
    def forward(ctx, x, send, recv, ep):
        ctx.send, ctx.recv, ctx.ep = send, recv, ep
        return _all_to_all(x, send, recv, ep)

    @staticmethod
    def backward(ctx, g):
        return _all_to_all(g.contiguous(), ctx.recv, ctx.send, ctx.ep), None, None, None


class ExpertParallel:
    """This rank's place in its expert-parallel group (``group``: ep ranks, each holding
    ``num_experts / ep`` experts, rank r the ids [r*E/ep, (r+1)*E/ep)) and the group of every rank
    whose tokens make the step (``token_group``, Topology's dp x cp: the router's counts are summed
    there, :meth:`token_totals`). Either group may be None (one rank: nothing sent)."""

    def __init__(self, group=None, token_group=None, num_experts: int | None = None):
        self.group, self.token_group = group, token_group
        if group is None:
            self.ranks, self.rank = [dist.get_rank() if dist.is_initialized() else 0], 0
        else:
            self.ranks = dist.get_process_group_ranks(group)
            self.rank = self.ranks.index(dist.get_rank())
        self.size = len(self.ranks)
        self.tokens_size = 1 if token_group is None else dist.get_world_size(token_group)
        self.num_experts = num_experts

    def local_ids(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        if num_experts % self.size:
            raise ConfigError(f"expert parallelism (ep={self.size}) splits the experts equally, but num_experts="
                              f"{num_experts} is not divisible by {self.size}; choose ep among "
                              f"{', '.join(str(d) for d in range(1, num_experts + 1) if num_experts % d == 0)}")
        per = num_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)

    def token_totals(self, stats: torch.Tensor) -> torch.Tensor:
        """The router's per-rank sums (counts, drops, tokens; (S,) float64) summed over every rank of
        the step: one all-reduce over the token group (exact: integer counts)."""
        if self.tokens_size == 1:
            return stats
        out = stats.clone()
        comm.all_reduce(out, op="sum", group=self.token_group, algorithm="native")
        return out

    def combine(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                experts: Mapping[int, nn.Module]) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for this rank's tokens x (N, C), the
        experts living on the ranks of the group (``experts``: this rank's). Collective over the group."""
        N, C = x.shape
        k = ids.shape[1]
        E = self.num_experts
        mine = self.local_ids(E)
        flat = ids.reshape(-1)                                                       # (N*k,) -1: dropped
        slots = torch.nonzero(flat >= 0, as_tuple=True)[0]
        order = torch.argsort(flat[slots], stable=True)
        slots = slots[order]                                                         # (M,) kept, expert-major
        tok = torch.div(slots, k, rounding_mode="floor")                             # (M,) each slot's token
        counts = torch.bincount(flat[slots], minlength=E).view(self.size, len(mine))  # (ep, E/ep) sent
        recv = _all_to_all(counts, [1] * self.size, [1] * self.size, self, COUNTS_LABEL)  # (ep, E/ep) received
        send_rows, recv_rows = counts.sum(1).tolist(), recv.sum(1).tolist()
        rows = _Exchange.apply(x.index_select(0, tok), send_rows, recv_rows, self)   # (R, C) source-, expert-major
        # regroup: local expert j's rows from every source, experts in order (perm), and back (inverse)
        start = torch.cumsum(recv.reshape(-1), 0) - recv.reshape(-1)                # (ep*E/ep,) block offsets
        perm = torch.cat([torch.arange(int(start[s * len(mine) + j]), int(start[s * len(mine) + j])
                                       + int(recv[s, j])) for j in range(len(mine)) for s in range(self.size)]
                         + [torch.zeros(0, dtype=torch.int64)]).to(x.device)
        chunks = rows.index_select(0, perm).split(recv.sum(0).tolist())              # per local expert
        out = torch.cat([experts[e](chunk) for e, chunk in zip(mine, chunks)])       # (R, C); every expert runs
        back = out.index_select(0, torch.argsort(perm))                               # source-, expert-major again
        ret = _Exchange.apply(back, recv_rows, send_rows, self)                       # (M, C) this rank's slots
        w = weights.reshape(-1)[slots].unsqueeze(-1).to(ret.dtype)                    # (M, 1)
        return x.new_zeros(N, C).index_add(0, tok, ret * w)

    def __repr__(self) -> str:
        return f"ExpertParallel(ep={self.size}, rank={self.rank}, num_experts={self.num_experts})"


def ep_bytes(routed: torch.Tensor, C: int, elem_size: int = 4) -> list[dict[str, int]]:
    """Bytes and messages of one MoE layer's forward + backward, per rank of the group, from the
    routing matrix ``routed`` (ep, ep): routed[i, j] = kept slots of rank i's tokens whose expert
    lives on rank j. Rank r sends S_r = sum_{j != r} routed[r, j] rows (dispatch) and receives
    R_r = sum_{i != r} routed[i, r] rows; combine sends R_r back and receives S_r; backward mirrors
    both, so it sends 2 (S_r + R_r) C e bytes per step (and receives the same). Messages: one per
    non-empty block, the same count each way. The count exchange (label ``ep-counts``) adds
    (ep - 1) messages of E/ep int64 each way per forward."""
    ep = routed.shape[0]
    out = []
    for r in range(ep):
        S = sum(int(routed[r, j]) for j in range(ep) if j != r)
        R = sum(int(routed[i, r]) for i in range(ep) if i != r)
        msgs = sum(1 for j in range(ep) if j != r and routed[r, j]) + \
            sum(1 for i in range(ep) if i != r and routed[i, r])
        out.append({"sent": 2 * (S + R) * C * elem_size, "recv": 2 * (S + R) * C * elem_size, "msgs_sent": 2 * msgs})
    return out
