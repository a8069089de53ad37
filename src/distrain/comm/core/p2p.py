"""Point-to-point messages: the layer every algorithm is written on.

Two faces:

* the public API, mirroring torch.distributed: ``send``, ``recv``, ``isend``, ``irecv``
  (ranks are *global* ranks, ``group`` optional), plus ``send_tensor``/``recv_tensor`` which
  send a small header (dtype, shape) first so the receiver needs to know nothing;
* :class:`PeerComm`, the view an algorithm gets of one collective call: group ranks
  0..size-1, the call's tag, and the ledger label. It counts every byte in the ledger.

Seeds: P2P communication (blocking ``send``/``recv`` and non-blocking ``isend``/``irecv``).
"""

from __future__ import annotations

import threading

import torch

from distrain.comm.core import ledger as _ledger
from distrain.comm.core import tags
from distrain.comm.core.group import GroupState, breakable, resolve
from distrain.comm.core.torchargs import torch_call
from distrain.comm.core.transport import Transport, Work
from distrain.comm.core.util import DTYPE_CODE, WIRE_DTYPES, check_int, dtype_name, nbytes
from distrain.errors import CommError, ConfigError
from distrain.comm.core.failures import lost


_workspace = threading.local()


def scratch(numel: int, dtype: torch.dtype, device, slot: int = 0) -> torch.Tensor:
    """A reusable temporary of ``numel`` elements (contents undefined).

    Why: a fresh large CPU allocation is returned to the OS when freed, and touching it
    again page-faults every 4 KiB page; here that cost 50 ms for 32 MiB, against 3 ms
    for the addition done in it. Buffers are cached per thread (an async collective runs
    on its group's worker thread while the caller may run another), per dtype, device and
    ``slot`` (one call needing two temporaries uses two slots); they grow, never shrink.
    """
    cache = getattr(_workspace, "buffers", None)
    if cache is None:
        cache = _workspace.buffers = {}
    key = (dtype, str(device), slot)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = cache[key] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]


def release_workspace() -> None:
    """Free this thread's cached temporaries."""
    _workspace.buffers = {}


class _Done:
    """A completed handle: zero-byte messages are skipped by both sides alike."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = _Done()


class _Breakable:
    """A torch point-to-point Work whose wait a broken group ends (GroupState.wait: an elastic rank's)."""

    __slots__ = ("work", "state", "what")

    def __init__(self, work, state: GroupState, what: str):
        self.work, self.state, self.what = work, state, what

    def wait(self, timeout=None) -> bool:
        if timeout is not None:
            return self.work.wait(timeout)
        self.state.wait([self.work], self.what)
        return True

    def is_completed(self) -> bool:
        return self.work.is_completed()


class PeerComm:
    """One collective call's view of its group: ranks are group ranks, one tag per call."""

    def __init__(self, state: GroupState, op: str, algorithm: str, tag: int,
                 transport: Transport | None = None):
        self.state = state
        self.rank = state.rank
        self.size = state.size
        self.op = op
        self.algorithm = algorithm
        self.tag = tag
        self.transport = transport if transport is not None else state.transport
        # torch's Works (transport "torch") in an elastic rank: their waits end when the group breaks
        self.breakable = self.transport.name == "torch" and breakable()

    def isend(self, t: torch.Tensor, peer: int) -> Work:
        if t.numel() == 0:
            return DONE
        _ledger.record(self.op, self.algorithm, sent=nbytes(t), msgs_sent=1)
        w = self.transport.isend(t, self.state.ranks[peer], self.state.group, self.tag)
        if self.breakable:
            return _Breakable(w, self.state, f"{self.op}(algorithm={self.algorithm}): send to group rank {peer}")
        return w

    def irecv(self, t: torch.Tensor, peer: int) -> Work:
        if t.numel() == 0:
            return DONE
        _ledger.record(self.op, self.algorithm, recv=nbytes(t), msgs_recv=1)
        w = self.transport.irecv(t, self.state.ranks[peer], self.state.group, self.tag)
        if self.breakable:
            return _Breakable(w, self.state, f"{self.op}(algorithm={self.algorithm}): receive from group rank {peer}")
        return w

    def send(self, t: torch.Tensor, peer: int) -> None:
        self.isend(t, peer).wait()

    def recv(self, t: torch.Tensor, peer: int) -> None:
        self.irecv(t, peer).wait()

    def sendrecv(self, send_t: torch.Tensor, dst: int, recv_t: torch.Tensor, src: int) -> None:
        """Send and receive at once (one ring step); both posted before either is waited on."""
        works = [self.irecv(recv_t, src), self.isend(send_t, dst)]
        for w in works:
            w.wait()


def waitall(works: list) -> None:
    """Wait for each of ``works`` in order; breakable Works of one group (an elastic rank's) in one handoff
    to a waiter thread, not one each (GroupState.wait)."""
    first = works[0] if works else None
    if type(first) is _Breakable and all(type(w) is _Breakable and w.state is first.state for w in works):
        first.state.wait([w.work for w in works], first.what if len(works) == 1 else
                         f"{first.what}, and {len(works) - 1} more message(s)")
        return
    for w in works:
        w.wait()


# ---------------------------------------------------------------------------------------
# Public point-to-point API (global ranks, like torch.distributed)
# ---------------------------------------------------------------------------------------

def _check(tensor, peer: int | None, what: str, name: str, group, tag: int) -> tuple[GroupState, int | None]:
    st = resolve(group, name)
    if not isinstance(tensor, torch.Tensor):
        raise ConfigError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise ConfigError(f"{name}: a {tensor.layout} tensor cannot be sent; call .to_dense() first")
    if not tensor.is_contiguous():
        raise ConfigError(f"{name}: tensor must be contiguous (call .contiguous() first)")
    check_int(tag, "tag (tags from 2**30 up are reserved for collectives, see comm/tags.py)", name,
              tags.USER.start, tags.USER.stop)
    if peer is None:  # any source (receives only)
        return st, None
    peer_g = st.group_rank(peer, what, name)
    if peer_g == st.rank:
        raise ConfigError(f"{name}: rank {st.ranks[st.rank]} cannot {name} to/from itself ({what}={peer})")
    return st, peer_g


class _P2PWork:
    """Handle for isend/irecv: wait() re-raises transport errors as CommError naming the peer."""

    def __init__(self, work, desc: str, group=None, state: GroupState | None = None):
        self._work = work
        self._desc = desc
        self._group = group
        # the work's group where its wait is breakable (a torch Work in an elastic rank: GroupState.wait)
        self._state = state if state is not None and isinstance(work, torch.distributed.Work) and breakable() else None

    def wait(self, timeout=None) -> bool:
        try:
            if timeout is None and self._state is not None:
                self._state.wait([self._work], self._desc)
            elif timeout is None:
                self._work.wait()
            else:
                self._work.wait(timeout)
        except CommError:  # already names the rank, peer and tag (shared-memory transport)
            raise
        except Exception as e:  # Gloo raises RuntimeError on peer loss or timeout: PeerLostError
            raise lost(self._desc, e) from e
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def source_rank(self) -> int:
        """The global rank the message came from (after wait; what an any-source irecv needs)."""
        self.wait()
        r = self._work._source_rank()
        return r if self._group is None else torch.distributed.get_global_rank(self._group, r)

    def _source_rank(self) -> int:
        """torch's Work._source_rank(): the sender's rank in the group (any-source receives)."""
        return self._work._source_rank()

    def get_future(self):
        return self._work.get_future()


def _p2p_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """What goes on the wire: detached (a Parameter receives in place like any tensor), complex as real."""
    t = tensor.detach()
    return torch.view_as_real(t) if t.is_complex() else t


@torch_call("dst")
def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, *,
          label: str = "p2p") -> _P2PWork:
    """Non-blocking send to global rank ``dst``. ``label`` names the traffic in the ledger."""
    if dst is None:
        raise ConfigError("isend: give dst= (a global rank) or group_dst= (a rank inside group)")
    st, peer = _check(tensor, dst, "dst", "isend", group, tag)
    _ledger.record(label, "p2p", sent=nbytes(tensor), msgs_sent=1)
    w = st.transport.isend(_p2p_tensor(tensor), st.ranks[peer], st.group, tag)
    return _P2PWork(w, f"isend from rank {st.ranks[st.rank]} to rank {dst} (tag {tag})", state=st)


@torch_call("src")
def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *,
          label: str = "p2p") -> _P2PWork:
    """Non-blocking receive from global rank ``src`` (None: from any rank) into ``tensor``."""
    st, peer = _check(tensor, src, "src", "irecv", group, tag)
    _ledger.record(label, "p2p", recv=nbytes(tensor), msgs_recv=1)
    me = st.ranks[st.rank]
    if peer is None:  # any source: Gloo's recv_anysource; Work._source_rank() tells who sent it
        if st.transport.name != "torch":
            raise ConfigError(f"irecv on rank {me}: a receive from any source (src=None) needs transport 'torch'; "
                              f"this group uses {st.transport.name!r}: give src=, or set_transport('torch', group)")
        w = torch.distributed.irecv(_p2p_tensor(tensor), src=None, group=st.group, tag=tag)
        return _P2PWork(w, f"irecv on rank {me} from any rank (tag {tag})", group=group, state=st)
    w = st.transport.irecv(_p2p_tensor(tensor), st.ranks[peer], st.group, tag)
    return _P2PWork(w, f"irecv on rank {me} from rank {src} (tag {tag})", state=st)


@torch_call("dst")
def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0, *, label: str = "p2p") -> None:
    """Blocking send: returns once the tensor may be reused."""
    isend(tensor, dst, group, tag, label=label).wait()


@torch_call("src", nonmember_result=-1)
def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, *, label: str = "p2p") -> int:
    """Blocking receive into ``tensor``; returns the sender's global rank (``src=None``: any rank)."""
    w = irecv(tensor, src, group, tag, label=label)
    return w.source_rank() if src is None else (w.wait() and src)


# -- self-describing messages: header (dtype, shape) then payload -------------------------
MAX_NDIM = 8
_HEADER_LEN = 2 + MAX_NDIM  # [dtype code, ndim, shape..., padded with -1]


def _header(t: torch.Tensor) -> torch.Tensor:
    if t.dim() > MAX_NDIM:
        raise ConfigError(f"send_tensor: at most {MAX_NDIM} dimensions are supported, got {t.dim()}")
    if t.dtype not in DTYPE_CODE:
        raise ConfigError(f"send_tensor: dtype {t.dtype} is not supported; use one of "
                          f"{', '.join(dtype_name(d) for d in WIRE_DTYPES)}")
    h = torch.full((_HEADER_LEN,), -1, dtype=torch.int64)
    h[0] = DTYPE_CODE[t.dtype]
    h[1] = t.dim()
    h[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def isend_tensor(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *,
                 label: str = "p2p") -> list[tuple[_P2PWork, torch.Tensor]]:
    """Non-blocking :func:`send_tensor`: returns [(handle, tensor sent), ...] (header, payload).

    Keep the list until every handle has completed: the backend reads the tensors until then.
    """
    tensor = tensor.detach().contiguous()
    h = _header(tensor)
    out = [(isend(h, dst, group, tag, label=label), h)]
    if tensor.numel():
        out.append((isend(tensor, dst, group, tag, label=label), tensor))
    return out


def send_tensor(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, *, label: str = "p2p") -> None:
    """Send ``tensor`` preceded by a header, so :func:`recv_tensor` can allocate it."""
    for work, _ in isend_tensor(tensor, dst, group, tag, label=label):
        work.wait()


def recv_tensor(src: int, group=None, tag: int = 0, *, device=None, label: str = "p2p") -> torch.Tensor:
    """Receive a tensor sent with :func:`send_tensor`; its dtype and shape come from the header."""
    h = torch.empty(_HEADER_LEN, dtype=torch.int64)
    recv(h, src, group, tag, label=label)
    code, ndim = int(h[0]), int(h[1])
    if not (0 <= code < len(WIRE_DTYPES)) or not (0 <= ndim <= MAX_NDIM):
        raise CommError(f"recv_tensor from rank {src}: malformed header {h.tolist()} (was it sent with send_tensor?)")
    out = torch.empty([int(s) for s in h[2:2 + ndim]], dtype=WIRE_DTYPES[code], device=device)
    if out.numel():
        recv(out, src, group, tag, label=label)
    return out
