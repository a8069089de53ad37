"""The dispatcher under the collectives of api.py: argument checks, the debug fingerprint, one
``run_collective`` that records the call in the ledger and runs ours (inline or on the group's worker
thread), the transport's direct collectives, or torch.distributed's; and the async handle.

Contract: every rank of the group calls ``run_collective`` for the same collectives in the same order
(the call's sequence number is the P2P tag, see core/tags.py); with debug checks on, each call first
all-gathers a fingerprint of (call number, collective, algorithm, op, dtype, root, shape) and a
mismatch raises on every rank naming the rank that differs. Waits run under the collective
watchdog (core/watchdog.py), so a hung call names the ranks that did not arrive.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import Callable

import torch
import torch.distributed as dist

from distrain.comm.core import ledger as _ledger
from distrain.comm.core import registry, watchdog
from distrain.comm.core.group import GroupState
from distrain.comm.core.ops import COMPLEX_DTYPES, OPS, check_complex_op, check_dtype
from distrain.comm.core.p2p import PeerComm
from distrain.comm.algorithms import ALGORITHM_NAMES
from distrain.comm.core.util import DTYPE_CODE, dtype_name
from distrain.errors import CommError, ConfigError, PeerLostError
from distrain.comm.core.failures import lost
COLLECTIVES = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
               "reduce_scatter", "barrier")
_FP_NAMES = COLLECTIVES + ("all_to_all",)  # every collective a debug fingerprint can name
_FP_ALGORITHMS = ALGORITHM_NAMES + (registry.P2P,)  # and every algorithm (p2p: all_to_all_single's)

_debug = False


def set_debug(enabled: bool) -> None:
    """Turn the cross-rank fingerprint check before every collective on or off."""
    global _debug
    _debug = bool(enabled)


def debug_enabled() -> bool:
    return _debug


# ---------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------

class CommHandle:
    """What async_op=True returns, with torch's Work methods.

    ``wait(timeout=None)`` blocks until the result is in place (under the watchdog as its collective,
    ``seq`` its sequence number in its group); ``is_completed()``;
    ``get_future()`` a ``torch.futures.Future`` whose value is the output tensors;
    ``result()`` the output tensors (after ``wait``); ``exception()`` the error or None.
    """

    def __init__(self, desc: str, future: Future | None = None, work=None,
                 after: Callable[[], None] | None = None, outputs: list | None = None, seq: int | None = None):
        self._desc = desc
        self.seq = seq
        self._future = future
        self._work = work
        self._after = after
        self._outputs = list(outputs or [])
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _finish(self) -> None:
        """Run the copy-back once, whoever completes the handle first (wait or a future callback)."""
        with self._lock:
            if not self._done:
                if self._after is not None:
                    self._after()
                self._done = True

    def wait(self, timeout: float | None = None) -> bool:
        if self._done:
            return True
        try:
            with watchdog.blocking(self._desc, self.seq):
                if self._future is not None:
                    self._future.result(timeout)
                elif self._work is not None:
                    self._work.wait() if timeout is None else self._work.wait(_td(timeout))
            self._finish()
        except CommError as e:
            self._error = e
            raise
        except TimeoutError as e:
            raise PeerLostError(f"{self._desc}: not completed within {timeout}s") from e
        except Exception as e:
            self._error = lost(self._desc, e)
            raise self._error from e
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        if self._future is not None:
            return self._future.done()
        return self._work is None or self._work.is_completed()

    def result(self) -> list:
        self.wait()
        return self._outputs

    def set_outputs(self, outputs: list) -> None:
        """What result() and the future's value are (a form built on this call: its own output)."""
        self._outputs = list(outputs)

    def exception(self) -> BaseException | None:
        """The error this operation ended with (None while running or after success)."""
        if self._error is None and self.is_completed() and not self._done:
            try:
                self.wait()
            except CommError:
                pass
        return self._error

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()

        def settle(done=None) -> None:
            # Runs on the thread that completed the operation: read the finished future, never
            # wait on the work (Gloo calls this before the work counts as complete).
            try:
                if done is not None:
                    done.result() if isinstance(done, Future) else done.value()
                self._finish()
                fut.set_result(self._outputs)
            except Exception as e:  # noqa: BLE001 - delivered to whoever waits on the future
                self._error = lost(self._desc, e)
                fut.set_exception(self._error)

        if self._future is not None:
            self._future.add_done_callback(settle)
        elif self._work is not None:
            self._work.get_future().add_done_callback(settle)
        else:
            settle()
        return fut


def chain(h, then, outputs: list, desc: str) -> CommHandle:
    """A handle that completes once ``h`` has and ``then()`` (the copy-out) has run."""
    fut: Future = Future()

    def done(tf) -> None:
        try:
            tf.value()
            then()
            fut.set_result(None)
        except Exception as e:  # noqa: BLE001 - delivered to whoever waits
            fut.set_exception(e)

    h.get_future().add_done_callback(done)
    return CommHandle(desc, future=fut, outputs=outputs, seq=getattr(h, "seq", None))


def _td(seconds: float):
    from datetime import timedelta
    return timedelta(seconds=seconds)


# ---------------------------------------------------------------------------------------
# Validation helpers
# ---------------------------------------------------------------------------------------

def checked_tensor(t, what: str, collective: str, op=None) -> torch.Tensor:
    """The tensor the algorithms work on: detached (it shares t's storage, so results land in t,
    but autograd never sees our in-place writes: a leaf Parameter works as with torch), and a
    complex tensor as its real view (..., 2), which Gloo and our algorithms move and sum alike."""
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{collective}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise ConfigError(f"{collective}: {what} is a {t.layout} tensor; only dense (strided) tensors are "
                          f"supported: call .to_dense() first (all_reduce with algorithm='native' takes sparse COO)")
    if t.dtype in COMPLEX_DTYPES:
        if op is not None:
            check_complex_op(op, t.dtype, collective)
        return torch.view_as_real(t.detach())
    check_dtype(t.dtype, collective)
    return t.detach()


def checked_tensor_list(lst, ref: torch.Tensor, size: int, what: str, collective: str, rank: int) -> list[torch.Tensor]:
    if not isinstance(lst, (list, tuple)):
        raise ConfigError(f"{collective}: {what} must be a list of {size} tensors, got {type(lst).__name__}")
    if len(lst) != size:
        raise ConfigError(
            f"{collective}: {what} on rank {rank} has {len(lst)} tensors but the group has {size} ranks; "
            f"pass exactly one tensor per rank"
        )
    lst = [checked_tensor(t, f"{what}[{i}]", collective) for i, t in enumerate(lst)]
    for i, t in enumerate(lst):
        if t.shape != ref.shape or t.dtype != ref.dtype:
            raise ConfigError(
                f"{collective}: {what}[{i}] on rank {rank} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                f"but the tensor argument has shape {tuple(ref.shape)} and dtype {ref.dtype}; they must match"
            )
    return lst


def root_list(st: GroupState, root: int, lst, ref: torch.Tensor, what: str, role: str, root_global: int,
              collective: str) -> list[torch.Tensor] | None:
    """The list argument of scatter/gather: validated on the root, absent (None or []) elsewhere."""
    me = st.ranks[st.rank]
    if st.rank == root:
        if lst is None:
            raise ConfigError(f"{collective}: {what} is required on the {role} rank {root_global}")
        return checked_tensor_list(lst, ref, st.size, what, collective, me)
    if lst:
        raise ConfigError(f"{collective}: {what} must be None or empty on rank {me}, which is not the {role} "
                          f"({root_global})")
    return None


def flat_view(t: torch.Tensor) -> torch.Tensor:
    """A flat contiguous view of t if possible, else a flat copy (the caller copies back)."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1).clone()


def copy_back(dst: torch.Tensor, flat: torch.Tensor) -> None:
    if not (dst.is_contiguous() and flat.data_ptr() == dst.data_ptr()):
        dst.copy_(flat.view(dst.shape))


# ---------------------------------------------------------------------------------------
# Debug fingerprints
# ---------------------------------------------------------------------------------------

_OP_CODES = {name: i for i, name in enumerate(OPS)}  # stable across processes (unlike hash())
_FIELDS = ("call number", "collective", "algorithm", "op", "dtype", "root", "numel", "shape")
_MAXD = 6


def _fingerprint_check(st: GroupState, seq: int, collective: str, algorithm: str, op: str,
                       t: torch.Tensor | None, root: int) -> None:
    shape = tuple(t.shape) if t is not None else ()
    fp = [seq, _FP_NAMES.index(collective), _FP_ALGORITHMS.index(algorithm),
          _OP_CODES[op] if op else -1,
          DTYPE_CODE.get(t.dtype, -2) if t is not None else -1, root,
          t.numel() if t is not None else -1, len(shape)]
    fp += list(shape[:_MAXD]) + [-1] * (_MAXD - min(len(shape), _MAXD))
    mine = torch.tensor(fp, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(st.size)]
    dist.all_gather(rows, mine, group=st.group)

    def describe(row: torch.Tensor) -> str:
        r = row.tolist()
        dt = next((dtype_name(d) for d, c in DTYPE_CODE.items() if c == r[4]), "none")
        shp = tuple(x for x in r[8:8 + min(r[7], _MAXD)])
        alg = _FP_ALGORITHMS[r[2]] if 0 <= r[2] < len(_FP_ALGORITHMS) else "?"
        return (f"call #{r[0]} {_FP_NAMES[r[1]]}(algorithm={alg}) dtype={dt} shape={shp}"
                + (f" root={r[5]}" if r[5] >= 0 else ""))

    ref = rows[0]
    bad = [i for i, row in enumerate(rows) if not torch.equal(row, ref)]
    if bad:
        lines = [f"  group rank {i} (global rank {st.ranks[i]}): {describe(rows[i])}" for i in range(st.size)]
        diff = sorted({_FIELDS[min(j, 7)] for i in bad for j in range(len(fp)) if rows[i][j] != ref[j]})
        raise CommError(
            f"{collective}: ranks disagree (debug check) on {', '.join(diff)}; rank(s) "
            f"{[st.ranks[i] for i in bad]} differ from rank {st.ranks[0]}. Every rank must call the same "
            f"collectives in the same order with matching shapes and dtypes:\n" + "\n".join(lines)
        )


# ---------------------------------------------------------------------------------------
# The dispatcher
# ---------------------------------------------------------------------------------------

_NO_WATCH = contextlib.nullcontext()


def run_collective(st: GroupState, collective: str, algorithm: str, async_op: bool, payload: int, mod,
                   ours: Callable[[object, PeerComm], None], native: Callable[[bool], object] | None,
                   after: Callable[[], None] | None, fp: tuple, outputs: list | None = None,
                   label: str | None = None) -> CommHandle | None:
    """Run one collective call: fingerprint, ledger, then ours (inline or on the worker) or native.

    ``mod`` is the registered algorithm, or None for "native": then the group's transport may
    provide its own (the direct shared-memory collectives), else torch.distributed's runs.
    ``outputs``: what the handle's result() returns (default: the tensor of ``fp``). ``label``: the
    name the ledger counts the call and its messages under (default: the collective's).
    """
    seq = st.next_seq()
    if _debug:
        _fingerprint_check(st, seq, collective, algorithm, *fp)
    label = label or collective
    _ledger.record(label, algorithm, calls=1, payload=payload)
    outs = outputs if outputs is not None else [t for t in fp[1:2] if t is not None]
    transport = st.transport
    key = (collective, algorithm, transport.name)  # the description is made once per kind of call
    desc = st.descs.get(key)
    if desc is None:
        desc = st.descs[key] = f"{collective}(algorithm={algorithm}, transport={transport.name}) on rank {st.ranks[st.rank]} " \
                               f"(group rank {st.rank} of {st.size})"
    ordered = False  # the direct collectives share one slot per rank: calls run one at a time, in order
    if mod is None:
        mod = transport.direct(collective) if st.size > 1 else None
        ordered = mod is not None
    if mod is None:
        return _run_native(desc, native, async_op, after, outs, seq)

    pc = PeerComm(st, label, algorithm, st.tag(seq), transport)
    tensor = fp[1]  # an empty tensor moves nothing: every rank skips the algorithm alike
    skip = st.size == 1 or (tensor is not None and tensor.numel() == 0)

    def job() -> None:
        if not skip:
            try:
                ours(mod, pc)
            except BaseException:
                transport.abort()  # peers waiting on this rank stop at once
                raise
        if after is not None:
            after()

    if async_op:
        return CommHandle(desc, future=st.submit(job), outputs=outs, seq=seq)
    wd = watchdog.current()  # entered and left inline: a context manager costs a microsecond here
    if wd is not None:
        wd.enter(desc, seq)
    try:
        if ordered and st.pending:  # async calls before this one still run on the worker
            st.submit(job).result()
        else:
            job()
    except CommError:
        raise
    except Exception as e:
        raise lost(desc, e) from e
    finally:
        if wd is not None:
            wd.leave()
    return None


def _run_native(desc: str, native, async_op: bool, after, outs: list, seq: int) -> CommHandle | None:
    try:
        with watchdog.blocking(desc, seq) if not async_op else _NO_WATCH:
            work = native(async_op)
        if not async_op:
            if after is not None:
                after()
            return None
    except CommError:
        raise
    except Exception as e:
        raise lost(desc, e) from e
    return CommHandle(desc, work=work, after=after, outputs=outs, seq=seq)
