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

all_reduce of a tensor in symmetric memory (symmetric.py; every peer maps its counterpart)
skips the slots: two waits for the whole tensor, between them rank r reduces part r of all P
copies and writes it into every copy (:func:`_all_reduce_symmetric`). Each rank declares on its
SYMMETRIC line what it passes, so a rank that passes an ordinary tensor against symmetric ones
is named instead of reading the wrong memory.

reduce_scatter: step with the P pieces destined to each rank; rank r folds piece r of all
slots. all_gather / gather: each copies its piece in; readers copy all. broadcast / scatter:
the root copies in, the others copy out. reduce: all copy in, the root folds.

Why a slot is never overwritten while a peer reads it: see transport.py (double buffering and
the wait for every peer at each step).
"""

from __future__ import annotations

import torch

from distrain.comm.core.ops import Op
from distrain.comm.shm.segment import ARRIVE, CONSUMED, DONE, SYMMETRIC
from distrain.comm.shm.symmetric import OFFSET_BITS
from distrain.comm.core.util import chunk_sizes
from distrain.errors import CommError

SMALL_BYTES = 32 << 10
READS_INPUT_ONLY = True  # reduce_scatter reads its input in place (api.reduce_scatter skips the work copy)


def _sh(pc):
    return pc.transport


def _step(sh, what: str) -> int:
    """Start a step: peers' segments open, the step number for this chunk."""
    _open(sh, what)
    return sh.begin()


def _open(sh, what: str) -> None:
    """Every peer's segment mapped (the first collective of a group opens them)."""
    if len(sh.peers) < sh.size:
        sh.coll = what
        sh.open_all()


def _arrive(sh, step: int, what: str) -> None:
    sh.post(ARRIVE, step)
    sh.wait_all(ARRIVE, step, what)


def _bounds(c: int, P: int) -> list[tuple[int, int]]:
    out, lo = [], 0
    for k in chunk_sizes(c, P):
        out.append((lo, lo + k))
        lo += k
    return out


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
    _open(sh, what)
    K = sh.layout.slots
    base = sh.step
    sh.me.set_line(CONSUMED, base)  # every earlier step is read (steps run in order on a rank)
    # what each rank works on, checked once every peer arrived: only where symmetric memory exists
    # (its allocation is collective, so either every rank of the group has a heap or none has)
    line = _declare(sh, base + 1, 0) if sh.heap is not None else None
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
            _check_same(sh, line, what)
        fold(folded, s)
        folded += 1
        sh.post(CONSUMED, s)


CODE_BITS = 56  # SYMMETRIC line: (first step & STEP_MASK) << 56 | the tensor's code (0: slots); fits an int64
STEP_MASK = 0x7F


def _declare(sh, step: int, code: int) -> int:
    """Say what this rank's all_reduce starting at ``step`` works on (its SYMMETRIC line)."""
    line = (step & STEP_MASK) << CODE_BITS | code
    sh.me.set_line(SYMMETRIC, line)
    return line


def _kind(code: int) -> str:
    code &= (1 << CODE_BITS) - 1
    if not code:
        return "an ordinary tensor"
    return f"symmetric allocation {(code >> OFFSET_BITS) - 1} at byte offset {code & ((1 << OFFSET_BITS) - 1)}"


def _check_same(sh, line: int, what: str) -> None:
    """After every peer arrived at the first step: each declared the same kind of buffer. (A peer
    whose line carries another step has finished this call and moved on: nothing to compare.)"""
    tag = line >> CODE_BITS
    for q, seg in sh.peers.items():
        theirs = seg.line(SYMMETRIC)
        if theirs != line and theirs >> CODE_BITS == tag:
            raise mismatch(sh, q, theirs, line, what)


def mismatch(sh, q: int, theirs: int, line: int, what: str) -> CommError:
    """The error when rank q declared another buffer than this rank (the compiled check's too)."""
    return CommError(f"{what} on rank {sh.me_global}: rank {sh.ranks[q]} passed {_kind(theirs)}, this rank "
                     f"{_kind(line)}; every rank must pass its counterpart: a symmetric tensor "
                     f"(comm.symmetric_empty, same allocation and offset) everywhere, or ordinary ones everywhere")


def _declared(sh) -> int | None:
    """Where symmetric memory exists, declare that this collective works on ordinary memory (on
    the step its first arrival carries); the caller checks the peers after that arrival."""
    return _declare(sh, sh.step + 1, 0) if sh.heap is not None else None


def _symmetric_steps(sh, alloc, offset: int, what: str, work) -> None:
    """A collective on symmetric memory: declare it, arrive, check every peer passed the
    counterpart, ``work()`` on the peers' memory, then a second wait (DONE) so that no rank
    changes its buffer while a peer still reads it."""
    _open(sh, what)
    step = sh.begin()
    line = _declare(sh, step, alloc.code(offset))
    sh.post(ARRIVE, step)
    sh.wait_all(ARRIVE, step, what)
    _check_same(sh, line, what)
    work()
    sh.post(DONE, step)
    sh.wait_all(DONE, step, what)


def _all_reduce_symmetric(sh, buf: torch.Tensor, op: Op, alloc, offset: int, what: str) -> None:
    """all_reduce of a tensor in symmetric memory, in place in every rank's copy (two phases).

    After every rank arrived, rank r reduces part r (``tensor_split`` sizes) of all P buffers,
    read straight from the peers' memory in rank order 0..P-1, and writes the result into part r
    of every rank's buffer; once every rank is done, each buffer holds the whole result. Per
    rank: n elements read and n written, against the slot path's copy in, P reads and a write
    per element (the reduction work is split P ways and nothing is copied twice). Parts are
    disjoint, so no rank reads what another writes until the DONE wait.
    """
    P, r, n, es = sh.size, sh.rank, buf.numel(), buf.element_size()

    def work() -> None:
        bufs = [alloc.views[q][offset:offset + n * es].view(buf.dtype) for q in range(P)]
        lo, hi = _bounds(n, P)[r]
        c = max(1, sh.layout.slot_bytes // (2 * es))  # a chunk of each input and the result stay in cache
        for a in range(lo, hi, c):
            b = min(a + c, hi)
            parts = [x[a:b] for x in bufs]
            if r < 2:  # fold may write over its first or second input: straight into this rank's part
                out = parts[r]
            else:
                if sh.scratch is None or sh.scratch.numel() < sh.layout.slot_bytes:
                    sh.scratch = torch.empty(sh.layout.slot_bytes, dtype=torch.uint8)
                out = sh.scratch[:(b - a) * es].view(buf.dtype)
            op.fold(out, parts)
            for q in range(P):
                if parts[q] is not out:
                    parts[q].copy_(out)

    _symmetric_steps(sh, alloc, offset, what, work)


def _all_gather_symmetric(sh, full: torch.Tensor, n: int, alloc, offset: int, what: str) -> None:
    """all_gather into a (P, n) buffer in symmetric memory whose row r holds rank r's input:
    each rank copies the P-1 other rows straight from their owners' buffers (no slot copies)."""
    P, r, es = sh.size, sh.rank, full.element_size()

    def work() -> None:
        rows = full.view(P, n)
        for q in range(P):
            if q != r:
                rows[q].copy_(alloc.views[q][offset + q * n * es:offset + (q + 1) * n * es].view(full.dtype))

    _symmetric_steps(sh, alloc, offset, what, work)


def _reduce_scatter_symmetric(sh, out: torch.Tensor, full: torch.Tensor, op: Op, alloc, offset: int,
                              what: str) -> None:
    """reduce_scatter of a (P, n) input in symmetric memory: rank r folds block r of every rank's
    input straight from their memory, in rank order, in cache-sized pieces."""
    P, r, n, es = sh.size, sh.rank, out.numel(), out.element_size()

    def work() -> None:
        blocks = [alloc.views[q][offset + r * n * es:offset + (r + 1) * n * es].view(out.dtype) for q in range(P)]
        c = max(1, sh.layout.slot_bytes // (2 * es))
        for a in range(0, n, c):
            op.fold(out[a:a + c], [x[a:a + c] for x in blocks])

    _symmetric_steps(sh, alloc, offset, what, work)


def all_reduce(pc, buf: torch.Tensor, op: Op) -> None:
    sh, what = _sh(pc), f"{pc.op}(transport=shm)"
    where = sh.heap.locate(buf) if sh.heap is not None else None
    if where is not None:
        _all_reduce_symmetric(sh, buf, op, *where, what)
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
            _declare(sh, step, 0)
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
    parts = _bounds(c, P)
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
        _all_gather_symmetric(sh, full, n, *where, what)
        return
    rows = full.view(P, n)
    m = _chunk(sh, full)
    line = _declared(sh)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        sh.slot(r, step, full.dtype)[:c].copy_(rows[r, a:a + c])
        _arrive(sh, step, what)
        if line is not None:
            _check_same(sh, line, what)
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
        _reduce_scatter_symmetric(sh, out, full, op, *where, what)
        return
    m = _chunk(sh, out, per=P)
    line = _declared(sh)
    for a in range(0, n, m):
        c = min(m, n - a)
        step = _step(sh, what)
        sh.slot(r, step, out.dtype)[:P * c].view(P, c).copy_(full.view(P, n)[:, a:a + c])
        _arrive(sh, step, what)
        if line is not None:
            _check_same(sh, line, what)
            line = None
        op.fold(out[a:a + c], [sh.slot(q, step, out.dtype)[r * c:(r + 1) * c] for q in range(P)])


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share memory (an output inside the input it reduces)."""
    pa, pb = a.data_ptr(), b.data_ptr()
    return pa < pb + b.numel() * b.element_size() and pb < pa + a.numel() * a.element_size()


def traffic(coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
    """Nothing is sent: peers read the slots. (Elements copied are not messages.)"""
    return 0, 0
