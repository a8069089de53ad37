"""The compiled data plane: the shared-memory collectives run by a C++ extension (_dataplane.cpp).

Why: a 4 KiB all_reduce through the Python collectives costs about 105 Python calls, and the
time went to them, not to waiting for the peer. The extension does one call's whole hot path
(the flag protocol, spin-then-block waits, copies and reductions) with the GIL released, and
:class:`FastPath` lets ``comm.all_reduce``, ``broadcast``, ``all_gather``, ``reduce_scatter``
and ``barrier`` reach it in a handful of Python operations when nothing else is needed (a
blocking call, native algorithm, no debug fingerprint, no async call queued before it).

The Python modules stay the readable reference and the fallback: ``collectives.py`` is what the
C++ does, step for step, on the same segment layout, so a result has the same bits either way;
the tests run every equivalence check with both (``set_kernels``), and with both in one group.
Every number the C++ restates (codes, control lines, ring and wait constants) the extension
exports, and importing this module compares each with the Python one (:func:`check_extension`
against :func:`reference`): a build from other source is one DataPlaneMismatchError at import.

Kernels of a new group's shared-memory transport (:func:`set_kernels`, job-wide, or
``DISTRAIN_SHM_KERNELS`` through ``distrain.runtime.init``):

* ``"auto"`` (default): compiled when the extension was built at install, else Python;
* ``"compiled"``: the extension, or a ConfigError saying why it is missing;
* ``"python"``: the Python reference.

Contract of the module-level collectives (what :meth:`ShmTransport.direct` hands the
dispatcher in compiled mode): the same signatures as collectives.py; a call the extension
cannot take (a dtype or layout it does not know) runs the Python version, with the step counter
handed over both ways. A failure raises the same typed errors as the Python waits do.

Point-to-point's compiled path (the extension's byte rings under p2p.Channels) is compiled_p2p.py.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from distrain.comm.core import ledger
from distrain.comm.core import watchdog
from distrain.comm.core.ops import Op
from distrain.comm.shm import collectives, segment, symmetric, symmetric_collectives
from distrain.comm.shm.segment import Layout
from distrain.errors import ConfigError, DataPlaneMismatchError

KERNELS = ("auto", "compiled", "python")
_choice = "auto"
_fast_path = True  # set_fast_path
READS_INPUT_ONLY = True  # as collectives.py: reduce_scatter reads its input in place

# Reduction codes of the extension's calls (_dataplane.cpp's enum Op). The dispatcher finishes avg
# itself (a division after the sum), so its calls pass sum for avg (OP_CODES); the fast path lets
# the C++ divide.
CODES = {"sum": 0, "prod": 1, "min": 2, "max": 3, "band": 4, "bor": 5, "bxor": 6, "avg": 7}
OP_CODES = {**CODES, "avg": CODES["sum"]}
# What the extension's calls return (_dataplane.cpp's enum Status); each failure becomes the typed
# error the Python waits raise (error here; compiled_p2p.p2p_error and checked for the byte rings).
OK, UNSUPPORTED, PEER_ABORTED, PEER_DIED, TIMED_OUT, MISMATCH, CORRUPT = 0, 1, 2, 3, 4, 5, 6
BAD_WORDS = -2  # Rings.push/pull's offset, Rings.header's byte count: the ring's words are invalid (err_*)


def reference() -> dict[str, int | float]:
    """Every number the extension restates, as the Python side defines it (the reference): the
    codes of its calls above, the segment's layout (segment.py), the collectives' and symmetric
    memory's constants and the waits' timings. Keys are the extension's attribute names."""
    return {
        **{name: code for name, code in zip(("OK", "UNSUPPORTED", "PEER_ABORTED", "PEER_DIED", "TIMED_OUT",
                                             "MISMATCH", "CORRUPT"),
                                            (OK, UNSUPPORTED, PEER_ABORTED, PEER_DIED, TIMED_OUT, MISMATCH, CORRUPT))},
        **{f"OP_{op.upper()}": code for op, code in CODES.items()},
        "LINE_BYTES": segment.LINE,
        **{f"LINE_{name}": getattr(segment, name)
           for name in ("ARRIVE", "DONE", "ABORT", "PID", "RESULT", "SLEEPING", "CONSUMED", "SYMMETRIC")},
        "HEAD_LINE_0": Layout.head_line(0), "TAIL_LINE_0": Layout.tail_line(0),
        "LINES_PER_CHANNEL": Layout.head_line(1) - Layout.head_line(0),
        "SMALL_BYTES": collectives.SMALL_BYTES, "CODE_BITS": symmetric_collectives.CODE_BITS,
        "STEP_MASK": symmetric_collectives.STEP_MASK, "OFFSET_BITS": symmetric.OFFSET_BITS,
        "HEADER": segment.HEADER, "WORD_LIMIT": segment.WORD_LIMIT, "BAD_WORDS": BAD_WORDS,
        "SPIN_MAX_S": segment.SPIN_MAX_S, "SPIN_MIN_S": segment.SPIN_MIN_S, "MAX_BLOCK_S": segment.MAX_BLOCK,
        "CHECK_EVERY_S": segment.CHECK_EVERY,
    }


CALLS = ("fold", "stream_copy")  # the extension's functions called here by name (its classes: make_plane, ...)


def check_extension(module) -> None:
    """Raise DataPlaneMismatchError when ``module`` (the built extension) disagrees with
    :func:`reference` on any number, or lacks one or a function of CALLS: it was built from other source than the Python
    beside it (a stale build), and would read and write the segments at other places or misread
    the codes. The first difference, in one line naming both values."""
    where = getattr(module, "__file__", None) or getattr(module, "__name__", "the extension")
    for name, ours in reference().items():
        theirs = getattr(module, name, None)
        if theirs is None:
            raise DataPlaneMismatchError(
                f"the compiled data plane ({where}) has no {name}, the Python kernels say {ours}: it was built from "
                f"older source; rebuild it (make install)")
        if type(theirs) is not type(ours) or theirs != ours:
            raise DataPlaneMismatchError(
                f"the compiled data plane ({where}) says {name}={theirs!r}, the Python kernels say {ours!r}; "
                f"rebuild it (make install)")
    for name in CALLS:
        if not callable(getattr(module, name, None)):
            raise DataPlaneMismatchError(f"the compiled data plane ({where}) has no {name}(): it was built from older "
                                         f"source; rebuild it (make install)")


try:
    from distrain.comm.shm import _dataplane as ext
    MISSING: str | None = None
except ImportError as e:  # not built: no compiler at install, or a source checkout never installed
    ext = None
    MISSING = (f"the C++ extension distrain.comm.shm._dataplane is not built ({e}); `make install` (pip install "
               f"--no-build-isolation -e .) builds it where g++ is present")
if ext is not None:
    check_extension(ext)  # a build from other source: one error at import, never wrong bits later


def set_kernels(name: str) -> None:
    """Which kernels new shared-memory transports use: "auto", "compiled" or "python"."""
    global _choice
    if name not in KERNELS:
        raise ConfigError(f"shm kernels {name!r} unknown; use one of {', '.join(KERNELS)}")
    if name == "compiled" and ext is None:
        raise ConfigError(f"shm kernels 'compiled' asked for, but {MISSING}; or use 'python'")
    _choice = name


def set_fast_path(enabled: bool) -> None:
    """Whether groups whose compiled plane is made from now on are offered to the fast path
    (:class:`FastPath`; on by default). Off, their blocking calls take the dispatcher into this
    module's collectives: the same results and bookkeeping, more Python per call (for comparisons)."""
    global _fast_path
    _fast_path = bool(enabled)


def kernels() -> str:
    """What a transport built now uses: "compiled" or "python"."""
    return "python" if _choice == "python" or ext is None else "compiled"


def status() -> str:
    """One line for reports: the kernels in use and the instruction set they were built for."""
    if ext is None:
        return f"python ({MISSING})"
    return f"{kernels()} (extension built for {ext.isa()})"


def make_plane(sh):
    """The extension's Plane for transport ``sh``, every peer's segment open (addresses of the
    mappings sh keeps alive), its step and spin handed over, its symmetric allocations known."""
    segs = sh.open_all()
    lay = sh.layout
    base = [s.bytes.data_ptr() for s in segs]
    plane = ext.Plane(sh.rank, sh.size, lay.slots, lay.slot_bytes, base, [b + lay.coll_offset for b in base],
                      [s.wake_fd for s in segs], [lock_fd(s) for s in segs], float(sh.timeout),
                      threading.main_thread().ident)
    plane.step, plane.spin = sh.step, sh.spin
    for a in (sh.heap.allocs if sh.heap is not None else ()):
        add_symmetric(plane, sh, a)
    return plane


def lock_fd(seg) -> int:
    """The descriptor the extension tests a segment's owner through (segment.Segment.owner_alive):
    a peer's; -1 for this rank's own (never tested: its lock is this rank's)."""
    return -1 if seg.owner or seg.fd is None else seg.fd


def add_symmetric(plane, sh, alloc) -> None:
    plane.add_symmetric(alloc.index, alloc.nbytes, [alloc.views[q].data_ptr() for q in range(sh.size)])


# ---------------------------------------------------------------------------------------------
# The collectives the dispatcher calls (collectives.py's signatures)
# ---------------------------------------------------------------------------------------------

def _code(op: Op) -> int:
    return OP_CODES[op.name]


def _done(pc, rc: int, fallback) -> None:
    """After a call of the extension: nothing to do, the Python version, or the typed error."""
    sh = pc.transport
    if rc == OK:
        if not sh.fast:  # every rank arrived at a step: each has mapped this rank's segment
            sh.unlink_when_mapped()
            register(sh)
        return
    if rc == UNSUPPORTED:
        plane = sh.plane
        sh.step, sh.spin = plane.step, plane.spin
        try:
            fallback()
        finally:
            plane.step, plane.spin = sh.step, sh.spin
        return
    raise error(sh, rc, f"{pc.op}(transport={sh.name})")


def all_reduce(pc, buf: torch.Tensor, op: Op) -> None:
    _done(pc, pc.transport.compiled().all_reduce(buf, _code(op)), lambda: collectives.all_reduce(pc, buf, op))


def reduce(pc, buf: torch.Tensor, root: int, op: Op) -> None:
    _done(pc, pc.transport.compiled().reduce(buf, root, _code(op)), lambda: collectives.reduce(pc, buf, root, op))


def broadcast(pc, buf: torch.Tensor, root: int) -> None:
    _done(pc, pc.transport.compiled().broadcast(buf, root), lambda: collectives.broadcast(pc, buf, root))


def all_gather(pc, full: torch.Tensor, n: int) -> None:
    _done(pc, pc.transport.compiled().all_gather(full, n), lambda: collectives.all_gather(pc, full, n))


def gather(pc, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    _done(pc, pc.transport.compiled().gather(inp, full, root), lambda: collectives.gather(pc, inp, full, root))


def scatter(pc, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None:
    _done(pc, pc.transport.compiled().scatter(out, full, root), lambda: collectives.scatter(pc, out, full, root))


def reduce_scatter(pc, out: torch.Tensor, full: torch.Tensor, op: Op) -> None:
    _done(pc, pc.transport.compiled().reduce_scatter(out, full, _code(op)),
          lambda: collectives.reduce_scatter(pc, out, full, op))


traffic = collectives.traffic


def error(sh, rc: int, what: str) -> Exception:
    """The typed error for a failed call of the extension (the Python waits raise the same)."""
    plane = sh.plane
    q = plane.err_peer
    if rc == MISMATCH:
        return symmetric_collectives.mismatch(sh, q, plane.err_theirs, plane.err_mine, what)
    kind = {PEER_ABORTED: "aborted", PEER_DIED: "died", TIMED_OUT: "timeout"}[rc]
    return sh.lost(kind, q if q >= 0 else None, what, range(sh.size))


# ---------------------------------------------------------------------------------------------
# The fast path: api.py's blocking native calls, straight to the extension
# ---------------------------------------------------------------------------------------------

# op as the caller passes it (a name or a ReduceOp.X) -> its code
_FAST_OPS: dict = {**CODES, dist.ReduceOp.SUM: CODES["sum"], dist.ReduceOp.PRODUCT: CODES["prod"],
                   dist.ReduceOp.MIN: CODES["min"], dist.ReduceOp.MAX: CODES["max"], dist.ReduceOp.BAND: CODES["band"],
                   dist.ReduceOp.BOR: CODES["bor"], dist.ReduceOp.BXOR: CODES["bxor"], dist.ReduceOp.AVG: CODES["avg"]}


class FastPath:
    """A group's blocking native collectives in a few Python operations (see the module doc).

    Each method returns True when it ran the collective, False when the caller must take the
    ordinary path (an async call queued on the group's worker, an op given as a ReduceOp
    object, a tensor or dtype the extension does not take: the ordinary path then also raises
    the proper error for bad arguments). What the ordinary path does besides, it does too: the
    group's call number, the ledger's call count, the watchdog's bracket, the abort on failure
    (tests/test_dataplane.py holds the two paths to the same state after the same calls).

    It lives on its group's state (``GroupState.fast``, looked up by ``group.fast_path``): one
    registry per group, dropped with the group.
    """

    __slots__ = ("state", "sh", "plane", "descs", "rank_of", "calls")

    def __init__(self, state, sh):
        self.state, self.sh, self.plane = state, sh, sh.plane
        self.calls = 0  # collectives this fast path ran (tests check that a group's calls came here)
        me = f"on rank {state.ranks[state.rank]} (group rank {state.rank} of {state.size})"
        self.descs = {c: f"{c}(algorithm=native, transport={sh.name}) {me}"
                      for c in ("all_reduce", "broadcast", "all_gather", "reduce_scatter", "barrier")}
        self.rank_of = {g: i for i, g in enumerate(state.ranks)}

    def _call(self, name: str, fn, *args) -> int:
        wd = watchdog.current()
        if wd is None:
            return fn(*args)
        wd.enter(self.descs[name], self.state.seq + 1)  # (the number _end takes once the call has run)
        try:
            rc = fn(*args)
        except BaseException:
            wd.leave()
            raise
        if rc == UNSUPPORTED:  # declined before any wait: the dispatcher runs the call and brackets it itself
            wd.withdraw()
        else:
            wd.leave()
        return rc

    def _end(self, name: str, rc: int, payload: int) -> bool:
        if rc:
            if rc == UNSUPPORTED:
                return False
            self.sh.abort()  # peers waiting on this rank stop at once
            raise error(self.sh, rc, f"{name}(transport={self.sh.name})")
        self.state.next_seq()
        self.calls += 1
        ledger.record(name, "native", calls=1, payload=payload)
        return True

    def all_reduce(self, t, op) -> bool:
        o = _FAST_OPS.get(op) if isinstance(op, (str, dist.ReduceOp.RedOpType)) else None
        if o is None or self.state.pending or not isinstance(t, torch.Tensor):
            return False
        return self._end("all_reduce", self._call("all_reduce", self.plane.all_reduce, t, o),
                         t.numel() * t.element_size())

    def broadcast(self, t, src) -> bool:
        root = self.rank_of.get(src) if isinstance(src, int) else None
        if root is None or self.state.pending or not isinstance(t, torch.Tensor):
            return False
        return self._end("broadcast", self._call("broadcast", self.plane.broadcast, t, root),
                         t.numel() * t.element_size())

    def all_gather(self, outs, t) -> bool:
        if self.state.pending or not isinstance(t, torch.Tensor) or not isinstance(outs, list) or \
                len(outs) != self.state.size:
            return False
        return self._end("all_gather", self._call("all_gather", self.plane.all_gather_list, outs, t),
                         t.numel() * t.element_size())

    def reduce_scatter(self, out, ins, op) -> bool:
        o = _FAST_OPS.get(op) if isinstance(op, (str, dist.ReduceOp.RedOpType)) else None
        if o is None or self.state.pending or not isinstance(out, torch.Tensor) or not isinstance(ins, list) or \
                len(ins) != self.state.size:
            return False
        return self._end("reduce_scatter", self._call("reduce_scatter", self.plane.reduce_scatter_list, out, ins, o),
                         out.numel() * out.element_size() * self.state.size)

    def barrier(self) -> bool:
        if self.state.pending:
            return False
        return self._end("barrier", self._call("barrier", self.plane.all_reduce, _TOKEN, 0), 0)


def fold(out: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
    """out = inputs[0] op inputs[1] op ... (in list order, avg divided by their number) by the
    extension's vectorised loops: the reduction every compiled collective runs (tests hold it to
    torch's bits). Contiguous CPU tensors of one dtype and length."""
    rc = ext.fold(out, inputs, CODES[op])
    if rc:
        raise ConfigError(f"fold({op}) of {out.dtype} is not supported by the compiled kernels")


def stream_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, the same bytes, by the extension's non-temporal stores where it is built and chosen
    (kernels() == "compiled") and both are contiguous CPU tensors of one dtype and shape: for a buffer written
    often and read only after a failure (pieces.InPlace, an elastic ZeRO rank's piece in symmetric memory),
    whose lines need not be read in first nor kept in cache. Otherwise torch's copy (the reference)."""
    if kernels() != "compiled" or dst.dtype != src.dtype or dst.shape != src.shape or \
            ext.stream_copy(dst, src) != OK:
        dst.copy_(src)


_TOKEN = torch.zeros(1, dtype=torch.uint8)  # a barrier is an all_reduce of one byte (api.barrier)


def register(sh) -> None:
    """Offer ``sh``'s group to the fast path (its Plane exists and its segments are unlinked): its
    FastPath goes on the group's state (unless :func:`set_fast_path` turned the fast path off)."""
    if _fast_path:
        sh.state.fast = FastPath(sh.state, sh)
    sh.fast = True


def unregister(sh) -> None:
    """Withdraw ``sh``'s group from the fast path (its transport is closing)."""
    fp = sh.state.fast
    if fp is not None and fp.sh is sh:
        sh.state.fast = None
