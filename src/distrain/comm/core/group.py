"""Per-process-group state: rank maps, the call sequence number, the async worker.

Contract (the same as torch.distributed's): every rank of a group calls the group's
collectives in the same order. That makes the per-group sequence number identical on every
rank, so it can serve as the P2P *tag* of a collective: two collectives in flight on the
same group (an async one on the worker thread, a sync one in the caller) never confuse
each other's messages, because their tags differ.

Asynchronous collectives of our own algorithms run on one worker thread per group, in
submission order (like a CUDA stream per communicator in NCCL).
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch.distributed as dist

from distrain.comm.core import tags
from distrain.comm.core import transport as transports
from distrain.comm.core.util import check_int
from distrain.errors import CommError, ConfigError


DRAIN_S = 10.0  # seconds GroupState.close waits for an interrupted async call to end


class _Worker:
    """One daemon thread running submitted callables in FIFO order."""

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn) -> Future:
        fut: Future = Future()
        self._q.put((fn, fut))
        return fut

    def _loop(self) -> None:
        while True:
            fn, fut = self._q.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # delivered to whoever waits on the handle
                fut.set_exception(e)


class GroupState:
    """What we keep per process group: global ranks, this rank, sequence number, worker."""

    def __init__(self, group):
        self.group = group
        self.ranks: list[int] = dist.get_process_group_ranks(group)  # group rank -> global rank
        self.rank: int = dist.get_rank(group)
        self.size: int = len(self.ranks)
        self.seq: int = 0
        self.pending = 0  # async jobs submitted to the worker and not finished
        self.descs: dict[tuple, str] = {}  # (collective, algorithm, transport) -> text for errors and the watchdog
        self._worker: _Worker | None = None
        self._lock = threading.Lock()
        self._transport_choice = None  # set_transport(); None = the job-wide default
        self._transport: transports.Transport | None = None
        # The fast path of this group's blocking native calls (shm/compiled.FastPath), set by its
        # shared-memory transport once the compiled plane runs (compiled.register), None otherwise.
        self.fast = None

    @property
    def transport(self) -> transports.Transport:
        """This group's transport, built on first use (see transport.py for the choice)."""
        if self._transport is None:
            choice = self._transport_choice or transports.default_transport()
            self._transport = transports.build(choice, self)
        return self._transport

    def set_transport(self, choice) -> None:
        if self._transport is not None:
            if choice is self._transport or choice == self._transport.name:
                return
            raise ConfigError(
                f"set_transport: the group of global ranks {self.ranks} already uses transport "
                f"{self._transport.name!r}; choose the transport before the group's first message"
            )
        if isinstance(choice, str):
            transports.check_name(choice, "set_transport")
        self._transport_choice = choice

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    def tag(self, seq: int) -> int:
        return tags.collective_tag(seq)

    def group_rank(self, global_rank: int, what: str, collective: str) -> int:
        """Map a global rank (as torch.distributed takes it) to this group's rank, or raise."""
        check_int(global_rank, f"{what} (a global rank)", collective)
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ConfigError(
                f"{collective}: {what}={global_rank} is not a member of the group (its global ranks are "
                f"{self.ranks}); pass the global rank of a group member"
            ) from None

    def submit(self, fn) -> Future:
        """Run ``fn`` on the group's worker thread, after everything submitted before it."""
        def counted():
            try:
                return fn()
            finally:
                with self._lock:
                    self.pending -= 1

        with self._lock:
            if self._worker is None:
                self._worker = _Worker(f"distrain-comm-g{id(self.group):x}")
            self.pending += 1
        return self._worker.submit(counted)

    def close(self) -> None:
        """Release the transport's resources (shared-memory segments); the state is forgotten. An async
        call still on the worker (a group that broke mid-step: an elastic rank leaving its epoch) may wait
        inside the transport's memory: its waits are interrupted first and the worker drained (at most
        DRAIN_S); a worker that does not drain keeps the memory mapped (its files are still removed)."""
        tr = self._transport
        if tr is None:
            return
        interrupt = getattr(tr, "interrupt", None)  # (a transport whose waits read its own memory: shm)
        drained = not self.pending or interrupt is None or self._drained(interrupt)
        self._transport = None
        if drained:
            tr.close()
        else:
            tr.unlink()

    def _drained(self, interrupt) -> bool:
        interrupt()
        try:
            self.submit(lambda: None).result(timeout=DRAIN_S)  # (FIFO: after every call queued before it)
        except Exception:  # noqa: BLE001 - still busy past DRAIN_S: the caller leaves the memory mapped
            return False
        return True


_states: dict[object, GroupState] = {}
_states_lock = threading.Lock()


def resolve(group, collective: str) -> GroupState:
    """The state of ``group`` (None = the default world group), checking this rank belongs to it."""
    if not dist.is_initialized():
        raise CommError(
            f"{collective}: torch.distributed is not initialized on this process; call "
            f"distrain.runtime.init() (under `distrain launch`/torchrun) or run the function with distrain.spawn()"
        )
    if group is None:
        group = dist.group.WORLD
    st = _states.get(group)
    if st is None:
        if dist.get_rank(group) < 0:
            raise ConfigError(
                f"{collective}: this process (global rank {dist.get_rank()}) is not a member of the group "
                f"it was called on; only the group's ranks may call it"
            )
        with _states_lock:
            st = _states.setdefault(group, GroupState(group))
    return st


def has_state(group) -> bool:
    """Whether ``group`` already has distrain state (a collective ran on it here); creates nothing."""
    return group in _states


def fast_path(group):
    """The fast path of ``group`` (None = the world): its state's ``fast``, or None when the group
    has no state yet or no fast path. Creates nothing (api.py asks on every blocking call)."""
    st = _states.get(dist.group.WORLD if group is None else group)
    return None if st is None else st.fast


def close_group(group=None) -> None:
    """Forget ``group``'s state and free its transport (call before destroying the group)."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    with _states_lock:
        st = _states.pop(group, None)
    if st is not None:
        st.close()


def interrupt_group(group=None) -> bool:
    """End every wait on ``group``'s transport at once, on this rank and on its peers: the group is
    over (an elastic job's epoch that lost a member). Safe from another thread while a call of the group
    blocks. Builds nothing: False when the group has no transport yet (nothing can wait on one), or its
    transport has no ``interrupt`` (an injected one), else True. The group cannot be used afterwards."""
    if group is None:
        if not dist.is_initialized():
            return False
        group = dist.group.WORLD
    st = _states.get(group)
    tr = st._transport if st is not None else None
    fn = getattr(tr, "interrupt", None)
    if fn is None:
        return False
    fn()
    return True


def close_all() -> None:
    """Free every group's transport (``distrain.runtime.shutdown`` calls it)."""
    with _states_lock:
        states = list(_states.values())
        _states.clear()
    for st in states:
        st.close()
