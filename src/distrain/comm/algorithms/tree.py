"""Tree collectives on a binomial tree: ceil(log2 P) rounds each way.

The seeds' "Tree-All-Reduce": the leaves send their arrays to their parents, which
reduce and pass the result up, level by level, to the root; the root then sends the
result back down the same tree. A message crosses only log2(P) levels instead of P-1 hops
of the ring, which wins for small (latency-bound) messages; each level moves the whole
array, so the traffic is log2(P)*N at the root each way (seeds: T = log2(P)*N).

The tree is the binomial tree of MPICH (Thakur, Rabenseifner & Gropp, "Optimization of
collective communication operations in MPICH", IJHPCA 2005), which works for any P, not
only powers of two. With v = (rank - root) mod P the rank's position:

* parent(v) = v - lowbit(v)            (v > 0; lowbit(v) = v & -v)
* children(v) = v + m for m = 1, 2, 4, ... while m < lowbit(v) (the root: m < P) and v + m < P
* subtree(v) holds positions [v, v + min(lowbit(v), P - v))   (the root: all P)

The root has exactly ceil(log2 P) children, so reduce and broadcast take ceil(log2 P)
rounds. Scatter and gather move whole subtrees: a child's message carries the slots of
every rank below it. all_reduce = reduce to 0 + broadcast from 0; all_gather = gather to
0 + broadcast; reduce_scatter = reduce of the P*n buffer to 0 + scatter from 0.

Buffer conventions are those of star.py.
"""

from __future__ import annotations

import sys

import torch

from distrain.comm.core import registry
from distrain.comm.core.ops import Op
from distrain.comm.core.p2p import PeerComm, scratch, waitall
from distrain.comm.core.util import COMPOSED_AT_ROOT

ROOT = 0


def lowbit(v: int) -> int:
    """The lowest set bit of v: v's parent in the binomial tree is v - lowbit(v)."""
    return v & -v


def _span(v: int, P: int) -> int:
    """How many consecutive positions the subtree of position v holds."""
    return P if v == 0 else min(lowbit(v), P - v)


def children(v: int, P: int) -> list[int]:
    """The children of (relative) rank v in the binomial tree of P ranks, in increasing order."""
    limit = P if v == 0 else lowbit(v)
    out, m = [], 1
    while m < limit and v + m < P:
        out.append(v + m)
        m <<= 1
    return out


def _real(v: int, root: int, P: int) -> int:
    return (v + root) % P


def broadcast(pc: PeerComm, buf: torch.Tensor, root: int) -> None:
    P = pc.size
    v = (pc.rank - root) % P
    if v:
        pc.recv(buf, _real(v - lowbit(v), root, P))
    # Largest subtree first: it has the most levels still to go.
    waitall([pc.isend(buf, _real(c, root, P)) for c in reversed(children(v, P))])


def reduce(pc: PeerComm, buf: torch.Tensor, root: int, op: Op) -> None:
    P = pc.size
    v = (pc.rank - root) % P
    kids = children(v, P)
    acc = buf
    if kids:
        # Inner nodes accumulate in a copy (non-root inputs stay intact); all receives are
        # posted at once, then folded in child order (smallest subtree first, deterministic).
        if v:
            acc = scratch(buf.numel(), buf.dtype, buf.device).copy_(buf)
        tmps = [scratch(buf.numel(), buf.dtype, buf.device, slot=1 + i) for i in range(len(kids))]
        works = [pc.irecv(t, _real(c, root, P)) for t, c in zip(tmps, kids)]
        for t, w in zip(tmps, works):
            w.wait()
            op.combine(acc, t)
    if v:
        pc.send(acc, _real(v - lowbit(v), root, P))


def all_reduce(pc: PeerComm, buf: torch.Tensor, op: Op) -> None:
    reduce(pc, buf, ROOT, op)
    broadcast(pc, buf, ROOT)


def _rotate_in(full: torch.Tensor, root: int, n: int) -> torch.Tensor:
    """full (slot i = rank i) -> buffer in position order (slot v = rank root+v)."""
    return full if root == 0 else torch.cat([full[root * n:], full[:root * n]])


def _rotate_out(rel: torch.Tensor, full: torch.Tensor, root: int, n: int, P: int) -> None:
    if rel.data_ptr() == full.data_ptr():
        return
    full[root * n:].copy_(rel[:(P - root) * n])
    full[:root * n].copy_(rel[(P - root) * n:])


def scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    P, n = pc.size, out.numel()
    v = (pc.rank - root) % P
    span = _span(v, P)
    if v == 0:
        rel = _rotate_in(full, root, n)
    else:
        rel = out if span == 1 else torch.empty(span * n, dtype=out.dtype, device=out.device)
        pc.recv(rel, _real(v - lowbit(v), root, P))
    sends = [pc.isend(rel[(c - v) * n:(c - v + _span(c, P)) * n], _real(c, root, P))
             for c in reversed(children(v, P))]
    if rel is not out:
        out.copy_(rel[:n])
    waitall(sends)


def gather(pc: PeerComm, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    P, n = pc.size, inp.numel()
    v = (pc.rank - root) % P
    span = _span(v, P)
    kids = children(v, P)
    if v == 0:
        rel = full if root == 0 else torch.empty_like(full)
    else:
        rel = inp if span == 1 else torch.empty(span * n, dtype=inp.dtype, device=inp.device)
    works = [pc.irecv(rel[(c - v) * n:(c - v + _span(c, P)) * n], _real(c, root, P)) for c in kids]
    if rel is not inp:
        rel[:n].copy_(inp)
    waitall(works)
    if v:
        pc.send(rel, _real(v - lowbit(v), root, P))
    else:
        _rotate_out(rel, full, root, n, P)


def all_gather(pc: PeerComm, full: torch.Tensor, n: int) -> None:
    own = full[pc.rank * n:(pc.rank + 1) * n]
    gather(pc, own.clone() if pc.rank == ROOT else own, full if pc.rank == ROOT else None, ROOT)
    broadcast(pc, full, ROOT)


def reduce_scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
    reduce(pc, full, ROOT, op)
    scatter(pc, out, full if pc.rank == ROOT else None, ROOT)


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """(elements sent, elements received) by ``rank`` in one call (notation of cost.py)."""
    v = (rank - (ROOT if coll in COMPOSED_AT_ROOT else root)) % P
    N = n = count
    span, kids, nonroot = _span(v, P), len(children(v, P)), 1 if v else 0
    table = {
        "all_reduce": (N * (kids + nonroot), N * (kids + nonroot)),
        "broadcast": (N * kids, N * nonroot),
        "reduce": (N * nonroot, N * kids),
        "scatter": ((span - 1) * n, span * n * nonroot),
        "gather": (span * n * nonroot, (span - 1) * n),
        # gather to 0, then broadcast of the P*n buffer
        "all_gather": (span * n * nonroot + P * n * kids, (span - 1) * n + P * n * nonroot),
        # reduce of the P*n buffer to 0, then scatter
        "reduce_scatter": (P * n * nonroot + (span - 1) * n, P * n * kids + span * n * nonroot),
    }
    return table[coll]


registry.register("tree", sys.modules[__name__])
