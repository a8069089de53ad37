"""Ring collectives: every rank talks only to its two ring neighbours.

The seeds' "Ring-All-Reduce": each rank splits its array into P chunks; in P-1 steps
every rank passes one chunk to the next rank and adds the chunk it receives from the
previous one (reduce-scatter), after which rank r owns the fully reduced chunk r; in P-1
more steps the reduced chunks travel once around the ring (all-gather). Every rank sends
2*(P-1) chunks of N/P bytes: T = 2*(N/P)*(P-1) per rank, independent of P for large P
(Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009; Baidu's ring all-reduce, 2017).

Chunk schedule (P ranks, r = this rank, next = r+1, prev = r-1, all mod P):

* reduce-scatter step s = 0..P-2: send chunk (r-s-1), receive chunk (r-s-2) and add it in.
  After the last step rank r holds reduced chunk r (what reduce_scatter must return).
* all-gather step s = 0..P-2: send chunk (r-s), receive chunk (r-s-1).

When N is not divisible by P the chunks are ``torch.tensor_split`` sizes (the first N mod P
chunks have one more element); rank r then sends exactly N - |c_r| elements in the
reduce-scatter and N - |c_(r+1)| in the all-gather.

Broadcast, scatter and gather use the ring as a pipeline (chain): the root's data moves
one hop per step, split into pieces so that every link is busy at once (broadcast), or
the items for the farthest ranks go first (scatter/gather). Reduce is composed:
reduce-scatter, then each rank sends its reduced chunk straight to the root.

Buffer conventions are those of star.py.
"""

from __future__ import annotations

import sys

import torch

from distrain.comm.core import registry
from distrain.comm.core.ops import Op
from distrain.comm.core.p2p import PeerComm, scratch, waitall
from distrain.comm.core.util import chunk_sizes

# Broadcast pipelines pieces of this many bytes (more pieces = more overlap, more messages).
PIPELINE_BYTES = 1 << 20
# Ring steps are pipelined in pieces of about this size (at most MAX_PIECES per chunk).
PIECE_BYTES = 1 << 20
MAX_PIECES = 16


def _pieces(t: torch.Tensor) -> list[torch.Tensor]:
    """Split a chunk into pipeline pieces; sender and receiver derive the same split from
    the chunk's size, so their messages match one to one."""
    k = min(MAX_PIECES, max(1, -(-t.numel() * t.element_size() // PIECE_BYTES)))
    return list(torch.tensor_split(t, k))


def _post_all_gather(pc: PeerComm, chunks: list[torch.Tensor]) -> tuple[list, list]:
    """Post every receive of the all-gather (each piece straight into its final place); returns
    (landing pieces, their receive works), step by step, for :func:`_all_gather_chunks`."""
    P, r = pc.size, pc.rank
    landing = [_pieces(chunks[(r - s - 1) % P]) for s in range(P - 1)]
    return landing, [[pc.irecv(x, (r - 1) % P) for x in step] for step in landing]


def _reduce_scatter_chunks(pc: PeerComm, chunks: list[torch.Tensor], op: Op,
                           gather_next: bool = False) -> tuple[list, list, list] | None:
    """The reduce-scatter. With ``gather_next`` (all_reduce) it also begins the all-gather: posts
    that phase's receives (after this phase's own, before the first send) and sends each piece of
    its now final chunk r as soon as the piece is reduced (the all-gather's step 0); returns
    (landing pieces, their receives, the sends still in flight) for :func:`_all_gather_chunks`."""
    P, r = pc.size, pc.rank
    nxt, prv = (r + 1) % P, (r - 1) % P
    # All receives are posted up front, each into its own scratch slot, and a piece is sent
    # on as soon as it has been reduced: no rank idles on a handshake between steps (on a
    # busy CPU each wake-up can cost a scheduler tick), and additions overlap transfers.
    # Extra memory: (P-1)/P of the tensor.
    m = max(c.numel() for c in chunks)
    tmp = scratch((P - 1) * m, chunks[0].dtype, chunks[0].device)
    acc = [_pieces(chunks[(r - s - 2) % P]) for s in range(P - 1)]  # step s adds into these
    incoming = [_pieces(tmp[s * m:s * m + chunks[(r - s - 2) % P].numel()]) for s in range(P - 1)]
    recvs = [[pc.irecv(x, prv) for x in step] for step in incoming]
    # Gloo's TCP pair sends a message only once the receiver's "receive ready" notice has reached
    # the sender (gloo/transport/tcp/pair.cc: Pair::send queues it until handleRemotePendingRecv), so a
    # receive posted only when the all-gather starts would hold that phase's first piece for one more
    # one-way latency (docs/cost_model.md, "Latency"). Posted now, its notices travel during this
    # phase. They match in posting order: prev sends this phase's pieces before the all-gather's.
    gathered = _post_all_gather(pc, chunks) if gather_next else None
    sends = [pc.isend(x, nxt) for x in _pieces(chunks[(r - 1) % P])]  # step 0: our own data
    for s in range(P - 1):
        for j, (a, x) in enumerate(zip(acc[s], incoming[s])):
            recvs[s][j].wait()
            op.combine(a, x)
            # the chunk reduced at step s is the one sent at step s + 1; the last (chunk r, final) is
            # the all-gather's first: a piece goes on as soon as it is, as costmodel/schedules.py has it
            if s < P - 2 or gathered is not None:
                sends.append(pc.isend(a, nxt))
    if gathered is not None:
        return (*gathered, sends)
    waitall(sends)  # a piece in flight is never written again in this phase
    return None


def _all_gather_chunks(pc: PeerComm, chunks: list[torch.Tensor], started: tuple[list, list, list] | None = None) -> None:
    P, r = pc.size, pc.rank
    nxt = (r + 1) % P
    # Receives go straight to their final place, all posted up front (or already, by the
    # reduce-scatter: ``started``, with step 0's sends); each received piece is forwarded as soon as it
    # lands. A chunk's piece lands only after prev holds it reduced, so after this rank's last use of
    # it in the reduce-scatter (its send there has been received downstream).
    if started is None:
        landing, recvs = _post_all_gather(pc, chunks)
        sends = [pc.isend(x, nxt) for x in _pieces(chunks[r])]
    else:
        landing, recvs, sends = started
    for s in range(P - 1):
        for j, x in enumerate(landing[s]):
            recvs[s][j].wait()
            if s < P - 2:
                sends.append(pc.isend(x, nxt))
    waitall(sends)


def all_reduce(pc: PeerComm, buf: torch.Tensor, op: Op) -> None:
    chunks = list(torch.tensor_split(buf, pc.size))
    _all_gather_chunks(pc, chunks, _reduce_scatter_chunks(pc, chunks, op, gather_next=True))


def reduce_scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
    chunks = list(full.view(pc.size, -1))
    _reduce_scatter_chunks(pc, chunks, op)
    out.copy_(chunks[pc.rank])


def all_gather(pc: PeerComm, full: torch.Tensor, n: int) -> None:
    _all_gather_chunks(pc, list(full.view(pc.size, n)))


def reduce(pc: PeerComm, buf: torch.Tensor, root: int, op: Op) -> None:
    # Composed: reduce-scatter on a work copy (non-root inputs stay intact), then every
    # rank sends its reduced chunk to the root.
    work = buf if pc.rank == root else scratch(buf.numel(), buf.dtype, buf.device, slot=1).copy_(buf)
    chunks = list(torch.tensor_split(work, pc.size))
    _reduce_scatter_chunks(pc, chunks, op)
    if pc.rank == root:
        waitall([pc.irecv(chunks[p], p) for p in range(pc.size) if p != root])
    else:
        pc.send(chunks[pc.rank], root)


def broadcast(pc: PeerComm, buf: torch.Tensor, root: int) -> None:
    P = pc.size
    v = (pc.rank - root) % P  # position along the chain
    nxt, prv = (pc.rank + 1) % P, (pc.rank - 1) % P
    pieces = torch.tensor_split(buf, max(1, -(-buf.numel() * buf.element_size() // PIPELINE_BYTES)))
    if v == 0:
        waitall([pc.isend(p, nxt) for p in pieces])
        return
    recvs = [pc.irecv(p, prv) for p in pieces]
    sends = []
    for piece, w in zip(pieces, recvs):
        w.wait()
        if v < P - 1:  # forward while the next piece is still arriving
            sends.append(pc.isend(piece, nxt))
    waitall(sends)


def _relay(pc: PeerComm, bufs: list[torch.Tensor], src: int, dst: int, forward: int) -> list:
    """Receive ``bufs`` from ``src`` in order (all posted at once); pass the first ``forward``
    of them on to ``dst`` as each lands. Returns the sends still in flight."""
    recvs = [pc.irecv(b, src) for b in bufs]
    sends = []
    for i, (b, w) in enumerate(zip(bufs, recvs)):
        w.wait()
        if i < forward:
            sends.append(pc.isend(b, dst))
    return sends


def _slot(full: torch.Tensor, i: int, n: int) -> torch.Tensor:
    return full[i * n:(i + 1) * n]


def scatter(pc: PeerComm, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    # The root sends the items for ranks at distance P-1, P-2, ..., 1 down the chain; the
    # rank at distance v receives P-v items, forwards the first P-v-1 and keeps the last.
    P, n = pc.size, out.numel()
    v = (pc.rank - root) % P
    nxt, prv = (pc.rank + 1) % P, (pc.rank - 1) % P
    if v == 0:
        sends = [pc.isend(_slot(full, (root + d) % P, n), nxt) for d in range(P - 1, 0, -1)]
        out.copy_(_slot(full, root, n))
    else:
        bufs = [torch.empty_like(out) for _ in range(P - v - 1)] + [out]
        sends = _relay(pc, bufs, prv, nxt, forward=P - v - 1)
    waitall(sends)


def gather(pc: PeerComm, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    # Mirror of scatter: items flow towards the root (to prev); the rank at distance v
    # sends its own item, then forwards the P-1-v items coming from farther ranks.
    P, n = pc.size, inp.numel()
    v = (pc.rank - root) % P
    nxt, prv = (pc.rank + 1) % P, (pc.rank - 1) % P
    if v == 0:
        works = [pc.irecv(_slot(full, (root + d) % P, n), nxt) for d in range(1, P)]
        _slot(full, root, n).copy_(inp)
        waitall(works)
        return
    sends = [pc.isend(inp, prv)]
    bufs = [torch.empty_like(inp) for _ in range(P - 1 - v)]
    waitall(sends + _relay(pc, bufs, nxt, prv, forward=len(bufs)))


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """(elements sent, elements received) by ``rank`` in one call (notation of cost.py)."""
    N = n = count
    c, r, v = chunk_sizes(N, P), rank, (rank - root) % P
    if coll == "all_reduce":
        return (N - c[r]) + (N - c[(r + 1) % P]), (N - c[(r - 1) % P]) + (N - c[r])
    if coll in ("all_gather", "reduce_scatter"):
        return (P - 1) * n, (P - 1) * n
    if coll == "broadcast":
        return (N if v < P - 1 else 0), (N if v > 0 else 0)
    if coll == "reduce":
        rs_sent, rs_recv = N - c[r], N - c[(r - 1) % P]
        if v == 0:
            return rs_sent, rs_recv + (N - c[r])
        return rs_sent + c[r], rs_recv
    if coll == "scatter":
        return ((P - 1) * n, 0) if v == 0 else ((P - v - 1) * n, (P - v) * n)
    if coll == "gather":
        return (0, (P - 1) * n) if v == 0 else ((P - v) * n, (P - v - 1) * n)
    raise ValueError(f"ring.traffic: no model for {coll!r}")


registry.register("ring", sys.modules[__name__])
