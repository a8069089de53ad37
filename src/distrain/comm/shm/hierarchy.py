"""Hierarchical all_reduce for a group spread over several hosts (transport "auto").

Shared memory inside each host, torch's point-to-point between hosts, one leader per host
(its lowest group rank). The message is processed in slot-sized chunks; per chunk:

1. intra-host reduce-scatter over shared memory: every local rank copies its chunk into
   its slot (ARRIVE); local rank i folds part i of all local slots (rank order) and writes
   it back into its own slot (DONE);
2. the leader reads the L reduced parts straight from the local slots (the all-gather to
   the leader), then all-reduces the chunk with the other hosts' leaders: our ring
   algorithm over the leaders, on torch point-to-point (RESULT: it writes the result into
   its slot);
3. intra-host broadcast over shared memory: the other local ranks copy the result from
   the leader's slot.

Bytes between hosts: 2*(H-1)/H of the chunk per leader (ring over H hosts), against
2*(P-1)/P per rank for a flat ring over all P ranks; inside a host only memory copies.
Reductions fold in a fixed order (host-local in rank order, then the ring's), so every
rank gets the same bits. Other collectives of such a group use torch's native ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from distrain.comm.core import registry
from distrain.comm.core.ops import Op
from distrain.comm.core.p2p import PeerComm
from distrain.comm.shm.segment import ARRIVE, DONE, RESULT
from distrain.comm.core.transport import TORCH
from distrain.comm.core.util import chunk_bounds


def _plan(sh) -> SimpleNamespace:
    """Who is on this host (group ranks, sorted), and the leaders of all hosts (cached)."""
    plan = sh.hier_plan
    if plan is None:
        hosts: dict[str, list[int]] = {}
        for q in range(sh.size):
            hosts.setdefault(sh.info(q)[2], []).append(q)
        local = hosts[sh.host]
        leaders = sorted(ranks[0] for ranks in hosts.values())
        plan = sh.hier_plan = SimpleNamespace(local=local, leaders=leaders, leader=local[0],
                                               me=local.index(sh.rank))
        for q in local:
            sh.seg(q)
    return plan


def _leaders_comm(pc: PeerComm, sh, plan) -> PeerComm:
    """A PeerComm whose ranks 0..H-1 are the hosts' leaders, on torch point-to-point."""
    st = pc.state
    view = SimpleNamespace(group=st.group, ranks=[st.ranks[q] for q in plan.leaders],
                           rank=plan.leaders.index(sh.rank), size=len(plan.leaders), transport=TORCH)
    return PeerComm(view, pc.op, "hierarchical", pc.tag, TORCH)


def all_reduce(pc: PeerComm, buf: torch.Tensor, op: Op) -> None:
    sh, what = pc.transport, f"{pc.op}(transport=auto, hierarchical)"
    sh.coll = what
    plan = _plan(sh)
    L, i = len(plan.local), plan.me
    leading = sh.rank == plan.leader
    m = max(1, sh.layout.slot_bytes // buf.element_size())
    for a in range(0, buf.numel(), m):
        x = buf[a:a + m]
        c = x.numel()
        step = sh.begin()
        slots = [sh.slot(q, step, buf.dtype)[:c] for q in plan.local]
        slots[i].copy_(x)
        sh.post(ARRIVE, step)
        sh.wait_all(ARRIVE, step, what, peers=plan.local)
        sh.unlink_when_mapped()  # every rank of this host has mapped our segment by now
        bounds = chunk_bounds(c, L)
        lo, hi = bounds[i]
        op.fold(x[lo:hi], [s[lo:hi] for s in slots])
        slots[i][lo:hi].copy_(x[lo:hi])
        sh.post(DONE, step)
        if leading:
            sh.wait_all(DONE, step, what, peers=plan.local)
            for k, (lo, hi) in enumerate(bounds):
                if k != i:
                    x[lo:hi].copy_(slots[k][lo:hi])
            if len(plan.leaders) > 1:
                registry.get("ring", "all_reduce").all_reduce(_leaders_comm(pc, sh, plan), x, op)
            slots[i].copy_(x)
            sh.post(RESULT, step)
        else:
            sh.wait_all(RESULT, step, what, peers=[plan.leader])
            x.copy_(slots[0])


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """Not modelled per rank: the bytes between hosts depend on the placement."""
    raise ValueError("hierarchical all_reduce has no placement-free traffic model")
