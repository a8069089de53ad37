"""Collectives over a group's symmetric memory, and the declaration that keeps every rank on one path.

A tensor in symmetric memory (symmetric.py: every rank allocated it alike, every peer maps its
counterpart) needs no slots: the collective reads and writes the peers' copies in place, between
two waits for the whole tensor (:func:`symmetric_steps`):

* all_reduce (:func:`all_reduce`): rank r reduces part r (``tensor_split`` sizes) of all P copies,
  in rank order 0..P-1, and writes it into every copy;
* all_gather (:func:`all_gather`): into a (P, n) buffer whose row r holds rank r's input, each rank
  copies the other rows straight from their owners' buffers;
* reduce_scatter (:func:`reduce_scatter`): rank r folds block r of every rank's (P, n) input.

The declaration: where a group has symmetric memory, each rank says on its SYMMETRIC line what
its collective works on (:func:`declare`: the first step and the tensor's code, 0 for ordinary
memory), and once every peer arrived checks that each declared the same kind (:func:`check_same`),
so a rank that passes an ordinary tensor against symmetric ones is named (:func:`mismatch`, also
the compiled check's error) instead of reading the wrong memory. The slot path (collectives.py)
declares ordinary memory the same way (:func:`declared`).

Contract: called by collectives.py's entry points with the transport ``sh`` and the tensor's
(allocation, byte offset) from ``sh.heap.locate``; results have the bits of the slot path's (the
same fold, in the same rank order).
"""

from __future__ import annotations

import torch

from distrain.comm.core.ops import Op
from distrain.comm.core.util import chunk_bounds
from distrain.comm.shm.segment import ARRIVE, DONE, SYMMETRIC
from distrain.comm.shm.symmetric import OFFSET_BITS
from distrain.errors import CommError

CODE_BITS = 56  # SYMMETRIC line: (first step & STEP_MASK) << 56 | the tensor's code (0: slots); fits an int64
STEP_MASK = 0x7F


def declare(sh, step: int, code: int) -> int:
    """Say what this rank's collective starting at ``step`` works on (its SYMMETRIC line)."""
    line = (step & STEP_MASK) << CODE_BITS | code
    sh.me.set_line(SYMMETRIC, line)
    return line


def _kind(code: int) -> str:
    code &= (1 << CODE_BITS) - 1
    if not code:
        return "an ordinary tensor"
    return f"symmetric allocation {(code >> OFFSET_BITS) - 1} at byte offset {code & ((1 << OFFSET_BITS) - 1)}"


def check_same(sh, line: int, what: str) -> None:
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


def declared(sh) -> int | None:
    """Where symmetric memory exists, declare that this collective works on ordinary memory (on
    the step its first arrival carries); the caller checks the peers after that arrival."""
    return declare(sh, sh.step + 1, 0) if sh.heap is not None else None


def symmetric_steps(sh, alloc, offset: int, what: str, work) -> None:
    """A collective on symmetric memory: declare it, arrive, check every peer passed the
    counterpart, ``work()`` on the peers' memory, then a second wait (DONE) so that no rank
    changes its buffer while a peer still reads it."""
    sh.open_peers(what)
    step = sh.begin()
    line = declare(sh, step, alloc.code(offset))
    sh.post(ARRIVE, step)
    sh.wait_all(ARRIVE, step, what)
    check_same(sh, line, what)
    work()
    sh.post(DONE, step)
    sh.wait_all(DONE, step, what)


def all_reduce(sh, buf: torch.Tensor, op: Op, alloc, offset: int, what: str) -> None:
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
        lo, hi = chunk_bounds(n, P)[r]
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

    symmetric_steps(sh, alloc, offset, what, work)


def all_gather(sh, full: torch.Tensor, n: int, alloc, offset: int, what: str) -> None:
    """all_gather into a (P, n) buffer in symmetric memory whose row r holds rank r's input:
    each rank copies the P-1 other rows straight from their owners' buffers (no slot copies)."""
    P, r, es = sh.size, sh.rank, full.element_size()

    def work() -> None:
        rows = full.view(P, n)
        for q in range(P):
            if q != r:
                rows[q].copy_(alloc.views[q][offset + q * n * es:offset + (q + 1) * n * es].view(full.dtype))

    symmetric_steps(sh, alloc, offset, what, work)


def reduce_scatter(sh, out: torch.Tensor, full: torch.Tensor, op: Op, alloc, offset: int, what: str) -> None:
    """reduce_scatter of a (P, n) input in symmetric memory: rank r folds block r of every rank's
    input straight from their memory, in rank order, in cache-sized pieces."""
    P, r, n, es = sh.size, sh.rank, out.numel(), out.element_size()

    def work() -> None:
        blocks = [alloc.views[q][offset + r * n * es:offset + (r + 1) * n * es].view(out.dtype) for q in range(P)]
        c = max(1, sh.layout.slot_bytes // (2 * es))
        for a in range(0, n, c):
            op.fold(out[a:a + c], [x[a:a + c] for x in blocks])

    symmetric_steps(sh, alloc, offset, what, work)
