"""Direct shared-memory collectives: copy in once, then read straight from the peers' slots.

What ``algorithm="native"`` means on the shared-memory transport (the approach of
DeepSpeed's and oneCCL's CPU shared-memory all-reduce). Every rank owns a slot of
``SLOT_BYTES`` in its segment, double buffered. A message is processed in chunks that fit
the slot (cache-sized, so a chunk is still in cache when it is reduced); per chunk, one
*step*:

1. each rank copies its contribution into its slot and publishes the step number (ARRIVE);
2. it waits until every peer has published that step;
3. it reads what it needs straight from the peers' slots.

all_reduce of a chunk of c elements on P ranks, large chunks (two phases): in step 1 rank r
copies in only the P-1 parts the others reduce; after step 2 it reduces part r (``tensor_split``
sizes) of all P inputs (its own read from its buffer, the others' from their slots) in rank
order 0..P-1 into its own slot and output, publishes DONE, waits for every DONE, then copies the
other parts from their owners' slots: per rank (P-1)/P·c copied in, c read and c/P written by
the fold, c/P + (P-1)/P·c copied out; the reduction work is split P ways. Small chunks (< SMALL_BYTES) take one phase: every rank
reduces the whole chunk itself (same order everywhere, so every rank gets the same bits),
saving the second wait, which dominates latency. At P = 2 every chunk takes one phase: the
second wait costs more than reducing the whole chunk twice (measured 1.05-1.2x faster at
64 KiB-16 MiB on the loaded 2-core machine, both ways interleaved in one run).

A tensor in symmetric memory (symmetric.py; every peer maps its counterpart) skips the slots:
all_reduce, all_gather and reduce_scatter hand it to symmetric_collectives.py, which also holds
the declaration every rank makes (where the group has symmetric memory) of what it passes, so a
rank that passes an ordinary tensor against symmetric ones is named instead of reading the wrong
memory; the slot path below declares ordinary memory through it.

reduce_scatter: step with the P pieces destined to each rank; rank r folds piece r of all
slots. all_gather / gather: each copies its piece in; readers copy all. broadcast / scatter:
the root copies in, the others copy out. reduce: all copy in, the root folds.

Why a slot is never overwritten while a peer reads it: see transport.py (double buffering and
the wait for every peer at each step).
"""

from __future__ import annotations

import torch

from distrain.comm.core.ops import Op
from distrain.comm.core.util import chunk_bounds
from distrain.comm.shm import symmetric_collectives
from distrain.comm.shm.segment import ARRIVE, CONSUMED, DONE

SMALL_BYTES = 32 << 10
READS_INPUT_ONLY = True  # reduce_scatter reads its input in place (api.reduce_scatter skips the work copy)


def _sh(pc):
    return pc.transport


def _step(sh, what: str) -> int:
    """Start a step: peers' segments open, the step number for this chunk."""
    sh.open_peers(what)
    return sh.begin()


def _arrive(sh, step: int, what: str) -> None:
    sh.post(ARRIVE, step)
    sh.wait_all(ARRIVE, step, what)


def _chunk(sh, t: torch.Tensor, per: int = 1) -> int:
    """Elements per step so that ``per`` pieces of it fit in one slot."""
    return max(1, sh.layout.slot_bytes // (t.element_size() * per))


def _pipelined(sh, what: str, chunks: int, copy_in, fold) -> None:
    """One-phase steps for ``chunks`` chunks with up to ``slots - 1`` of them in flight.

    Chunk i is step s = base + 1 + i, in slot s % K (K = slots). A rank copies chunk i in
    (``copy_in(i, step)``, then ARRIVE = s) as soon as every peer has read the slot's previous
    use (their CONSUMED >= s - K) and it is fewer than K - 1 chunks ahead of its own folds;
    it folds chunk i (``fold(i, step)``, then CONSUMED = s) once every peer's ARRIVE >= s.
    Lock-step (K = 2) needs both ranks running at every chunk; on a machine with more runnable
    threads than cores the peer often is not, and then each chunk costs a wake-up. Here a rank
    runs ahead by K - 1 chunks, so a time slice does K - 1 chunks of work.

    Why the K - 1 bound: a rank's ARRIVE = s then implies its CONSUMED >= s - K + 1, so after
    the last chunk (every peer's ARRIVE >= last) every peer has read the slot that the next
    lock-step collective writes at once, as lock-step collectives assume.
    """
    sh.open_peers(what)
    K = sh.layout.slots
    base = sh.step
    sh.me.set_line(CONSUMED, base)  # every earlier step is read (steps run in order on a rank)
    # what each rank works on, checked once every peer arrived: only where symmetric memory exists
    # (its allocation is collective, so either every rank of the group has a heap or none has)
    line = symmetric_collectives.declare(sh, base + 1, 0) if sh.heap is not None else None
    posted = folded = 0
    while folded < chunks:
        while posted < chunks and posted - folded < K - 1:
            s = base + 1 + posted
            if not sh.all_at_least(CONSUMED, s - K):
                if posted > folded:
                    break  # fold what is here first: the peer may be waiting for that
                sh.wait_all(CONSUMED, s - K, what)
            copy_in(posted, s)
            sh.step = s
            sh.post(ARRIVE, s)
            posted += 1
        s = base + 1 + folded
        sh.wait_all(ARRIVE, s, what)
        if not folded and line is not None:
            symmetric_collectives.check_same(sh, line, what)
        fold(folded, s)
        folded += 1
        sh.post(CONSUMED, s)


def all_reduce(pc, buf: torch.Tensor, op: Op) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    where = sh.heap.locate(buf) if sh.heap is not None else None
    if where is not None:
        symmetric_collectives.all_reduce(sh, buf, op, *where, what)
        return
    P, r, n = sh.size, sh.rank, buf.numel()
    m = _chunk(sh, buf)
    if P == 2 or n * buf.element_size() < SMALL_BYTES:  # one phase for every chunk: pipelined
        def copy_in(i, step):
            x = buf[i * m:(i + 1) * m]
            sh.views(step, buf.dtype, x.numel())[r].copy_(x)

        def fold(i, step):
            x = buf[i * m:(i + 1) * m]
            op.fold(x, sh.views(step, buf.dtype, x.numel()))

        _pipelined(sh, what, -(-n // m), copy_in, fold)
        return
    for a in range(0, n, m):
        x = buf[a:a + m]
        c = x.numel()
        step = _step(sh, what)
        if not a and sh.heap is not None:
            symmetric_collectives.declare(sh, step, 0)
        if c * buf.element_size() < SMALL_BYTES:
            slots = sh.views(step, buf.dtype, c)
            slots[r].copy_(x)
            _arrive(sh, step, what)
            op.fold(x, slots)
            continue
        _reduce_parts(sh, x, sh.slot(r, step, buf.dtype)[:c], step, op, what)


def _reduce_parts(sh, x: torch.Tensor, mine: torch.Tensor, step: int, op: Op, what: str) -> None:
    """The two-phase all_reduce of one large chunk x (c elements) on rank r.

    Rank r copies in only the parts the other ranks reduce ((P-1)/P of the chunk); its own
    contribution to part r is read from x itself. The fold still takes the terms in rank order
    0..P-1, so the result has the same bits as folding all P slots. The folded part r goes to
    this rank's slot (where the peers copy it from) and then into x.
    """
    P, r, c = sh.size, sh.rank, x.numel()
    parts = chunk_bounds(c, P)
    lo, hi = parts[r]
    if lo > 0:
        mine[:lo].copy_(x[:lo])
    if hi < c:
        mine[hi:].copy_(x[hi:])
    _arrive(sh, step, what)
    slots = [sh.slot(q, step, x.dtype)[:c] for q in range(P)]
    if hi > lo:
        op.fold(mine[lo:hi], [x[lo:hi] if q == r else slots[q][lo:hi] for q in range(P)])
        x[lo:hi].copy_(mine[lo:hi])
    sh.post(DONE, step)
    sh.wait_all(DONE, step, what)
    for q, (qlo, qhi) in enumerate(parts):
        if q != r and qhi > qlo:
            x[qlo:qhi].copy_(slots[q][qlo:qhi])


def reduce(pc, buf: torch.Tensor, root: int, op: Op) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    m = _chunk(sh, buf)
    for a in range(0, buf.numel(), m):
        x = buf[a:a + m]
        step = _step(sh, what)
        sh.slot(sh.rank, step, buf.dtype)[:x.numel()].copy_(x)
        _arrive(sh, step, what)
        if sh.rank == root:
            op.fold(x, [sh.slot(q, step, buf.dtype)[:x.numel()] for q in range(sh.size)])


def broadcast(pc, buf: torch.Tensor, root: int) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    m = _chunk(sh, buf)
    for a in range(0, buf.numel(), m):
        x = buf[a:a + m]
        step = _step(sh, what)
        if sh.rank == root:
            sh.slot(root, step, buf.dtype)[:x.numel()].copy_(x)
        _arrive(sh, step, what)
        if sh.rank != root:
            x.copy_(sh.slot(root, step, buf.dtype)[:x.numel()])


def all_gather(pc, full: torch.Tensor, n: int) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    P, r = sh.size, sh.rank
    where = sh.heap.locate(full) if sh.heap is not None else None
    if where is not None:
        symmetric_collectives.all_gather(sh, full, n, *where, what)
        return
    rows = full.view(P, n)
    m = _chunk(sh, full)
    line = symmetric_collectives.declared(sh)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        sh.slot(r, step, full.dtype)[:c].copy_(rows[r, a:a + c])
        _arrive(sh, step, what)
        if line is not None:
            symmetric_collectives.check_same(sh, line, what)
            line = None
        for q in range(P):
            if q != r:
                rows[q, a:a + c].copy_(sh.slot(q, step, full.dtype)[:c])


def gather(pc, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    P, r, n = sh.size, sh.rank, inp.numel()
    m = _chunk(sh, inp)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        sh.slot(r, step, inp.dtype)[:c].copy_(inp[a:a + c])
        _arrive(sh, step, what)
        if r == root:
            rows = full.view(P, n)
            for q in range(P):
                if q != r:
                    rows[q, a:a + c].copy_(sh.slot(q, step, inp.dtype)[:c])


def scatter(pc, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    P, r, n = sh.size, sh.rank, out.numel()
    m = _chunk(sh, out, per=P)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        if r == root:
            sh.slot(r, step, out.dtype)[:P * c].view(P, c).copy_(full.view(P, n)[:, a:a + c])
        _arrive(sh, step, what)
        if r != root:
            out[a:a + c].copy_(sh.slot(root, step, out.dtype)[r * c:(r + 1) * c])


def reduce_scatter(pc, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    P, r, n = sh.size, sh.rank, out.numel()
    where = sh.heap.locate(full) if sh.heap is not None and not _overlap(out, full) else None
    if where is not None:
        symmetric_collectives.reduce_scatter(sh, out, full, op, *where, what)
        return
    m = _chunk(sh, out, per=P)
    line = symmetric_collectives.declared(sh)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        sh.slot(r, step, out.dtype)[:P * c].view(P, c).copy_(full.view(P, n)[:, a:a + c])
        _arrive(sh, step, what)
        if line is not None:
            symmetric_collectives.check_same(sh, line, what)
            line = None
        op.fold(out[a:a + c], [sh.slot(q, step, out.dtype)[r * c:(r + 1) * c] for q in range(P)])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory (an output inside the input it reduces)."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """Nothing is sent: peers read the slots. (Elements copied are not messages.)"""
    return 0, 0
