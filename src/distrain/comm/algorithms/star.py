"""Star (master-worker) collectives: every byte goes through one root.

This is the seeds' first all-reduce architecture ("Master-Worker"): one process is made
the master; workers send it their arrays, it reduces them into one (reduce), and sends
the result back to every worker (broadcast). The root carries all the traffic, so it is
the bottleneck as P grows: per all-reduce the root receives (P-1)*N bytes and sends
(P-1)*N bytes, each worker sends N and receives N (seeds: T = (P-1)*N).

Conventions shared by star.py, ring.py and tree.py (the api module prepares the buffers):

* ranks are group ranks 0..P-1; ``root`` is a group rank;
* ``buf`` / ``inp`` / ``out`` are flat contiguous 1-D tensors of n elements;
* ``full`` is a flat buffer of P*n elements, slot i = full[i*n:(i+1)*n] belongs to rank i
  (``None`` on ranks that do not hold it);
* reductions combine contributions in increasing group-rank order (deterministic);
* non-root inputs of reduce/gather are not modified.

Natural forms: broadcast, reduce, scatter, gather. Composed:
all_reduce = reduce to 0 + broadcast from 0; all_gather = gather to 0 + broadcast of the
P*n buffer; reduce_scatter = reduce of the P*n buffer to 0 + scatter from 0.
"""

from __future__ import annotations

import sys

import torch

from distrain.comm.core import registry
from distrain.comm.core.ops import Op
from distrain.comm.core.p2p import PeerComm, scratch, waitall
from distrain.comm.core.util import COMPOSED_AT_ROOT

ROOT = 0  # the master of the composed collectives


def _slot(full: torch.Tensor, i: int, n: int) -> torch.Tensor:
    return full[i * n:(i + 1) * n]


def broadcast(pc: PeerComm, buf: torch.Tensor, root: int) -> None:
    if pc.rank == root:
        waitall([pc.isend(buf, peer) for peer in range(pc.size) if peer != root])
    else:
        pc.recv(buf, root)


def reduce(pc: PeerComm, buf: torch.Tensor, root: int, op: Op) -> None:
    if pc.rank != root:
        pc.send(buf, root)
        return
    # The root posts every receive at once, then folds contributions in rank order 0..P-1.
    tmps = {p: scratch(buf.numel(), buf.dtype, buf.device, slot=p) for p in range(pc.size) if p != root}
    works = {p: pc.irecv(t, p) for p, t in tmps.items()}
    # buf becomes the accumulator; a root other than 0 keeps its own contribution aside
    own = scratch(buf.numel(), buf.dtype, buf.device, slot=root).copy_(buf) if root != 0 else buf

    def contribution(p: int) -> torch.Tensor:
        if p == root:
            return own
        works[p].wait()
        return tmps[p]

    if root != 0:
        buf.copy_(contribution(0))
    for p in range(1, pc.size):
        op.combine(buf, contribution(p))


def all_reduce(pc: PeerComm, buf: torch.Tensor, op: Op) -> None:
    reduce(pc, buf, ROOT, op)
    broadcast(pc, buf, ROOT)


def scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    n = out.numel()
    if pc.rank == root:
        works = [pc.isend(_slot(full, p, n), p) for p in range(pc.size) if p != root]
        out.copy_(_slot(full, root, n))
        waitall(works)
    else:
        pc.recv(out, root)


def gather(pc: PeerComm, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    n = inp.numel()
    if pc.rank == root:
        works = [pc.irecv(_slot(full, p, n), p) for p in range(pc.size) if p != root]
        _slot(full, root, n).copy_(inp)
        waitall(works)
    else:
        pc.send(inp, root)


def all_gather(pc: PeerComm, full: torch.Tensor, n: int) -> None:
    # full's own slot is already filled; gather the others at the root, then fan out.
    if pc.rank == ROOT:
        waitall([pc.irecv(_slot(full, p, n), p) for p in range(pc.size) if p != ROOT])
    else:
        pc.send(_slot(full, pc.rank, n), ROOT)
    broadcast(pc, full, ROOT)


def reduce_scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
    reduce(pc, full, ROOT, op)
    scatter(pc, out, full if pc.rank == ROOT else None, ROOT)


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """(elements sent, elements received) by ``rank`` in one call (notation of cost.py)."""
    v = (rank - (ROOT if coll in COMPOSED_AT_ROOT else root)) % P
    N = n = count
    table = {
        "broadcast": ((P - 1) * N, 0) if v == 0 else (0, N),
        "reduce": (0, (P - 1) * N) if v == 0 else (N, 0),
        "all_reduce": ((P - 1) * N, (P - 1) * N) if v == 0 else (N, N),
        "scatter": ((P - 1) * n, 0) if v == 0 else (0, n),
        "gather": (0, (P - 1) * n) if v == 0 else (n, 0),
        "all_gather": ((P - 1) * P * n, (P - 1) * n) if v == 0 else (n, P * n),
        "reduce_scatter": ((P - 1) * n, (P - 1) * P * n) if v == 0 else (P * n, n),
    }
    return table[coll]


registry.register("star", sys.modules[__name__])
