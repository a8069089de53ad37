"""Per-process-group state: rank maps, the call sequence number, the async worker.

Contract (the same as torch.distributed's): every rank of a group calls the group's
collectives in the same order. That makes the per-group sequence number identical on every
rank, so it can serve as the P2P *tag* of a collective: two collectives in flight on the
same group (an async one on the worker thread, a sync one in the caller) never confuse
each other's messages, because their tags differ.

Asynchronous collectives of our own algorithms run on one worker thread per group, in
submission order (like a CUDA stream per communicator in NCCL).

In an elastic rank (its watchdog holds an ``interrupt``: :func:`breakable`) a wait on a torch
point-to-point Work can be broken (:meth:`GroupState.wait`, :func:`interrupt_group`): Gloo cannot abort
one from Python, and one whose message was cut off mid-transfer is not woken when its socket is shut
down, so the wait runs on a waiter thread (one per concurrent wait, kept and reused) and the caller
waits for that thread or for the break.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

import torch.distributed as dist

from distrain.comm.core import tags, watchdog
from distrain.comm.core import transport as transports
from distrain.comm.core.util import check_int
from distrain.errors import CommError, ConfigError, PeerLostError


DRAIN_S = 10.0  # seconds GroupState.close waits for an interrupted async call to end


def breakable() -> bool:
    """Whether this process's waits on torch point-to-point Works can be broken by :func:`interrupt_group`:
    its watchdog hands an ``interrupt`` to its thread (an elastic rank, whose membership layer breaks the
    groups of an epoch that lost a member). Elsewhere a wait is torch's own, on the caller's thread."""
    wd = watchdog.current()
    return wd is not None and wd.interrupt is not None


class _Waiter:
    """A daemon thread that runs the waits of one :meth:`GroupState.wait` at a time.

    Idle waiters wait in ``_idle`` for the next wait (one per wait in flight at once: a caller and
    its group's worker thread; the thread and its handoff are made once, not per wait). A waiter whose
    caller left it (the group broke while its work waited) finishes that wait, at the group's time-out at
    the latest, and then ends: the work and its tensor stay referenced until Gloo lets go of them."""

    __slots__ = ("_go", "done", "_mu", "works", "error", "finished", "left")

    def __init__(self):
        self._go = threading.Lock()
        self._go.acquire()  # released by start(): a wait to run
        self.done = threading.Lock()
        self.done.acquire()  # released once the wait ended, or by the break (wake)
        self._mu = threading.Lock()  # finished / left: who owns the end of a wait
        self.works, self.error, self.finished, self.left = None, None, False, False
        threading.Thread(target=self._loop, name="distrain-wait", daemon=True).start()

    def start(self, works: list) -> None:
        self.works, self.error, self.finished = works, None, False
        self._go.release()

    def _loop(self) -> None:
        while True:
            self._go.acquire()
            try:
                for w in self.works:
                    w.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.error = e
            with self._mu:
                self.finished = True
                if self.left:  # the caller is gone (a broken group): this thread ends with its wait
                    return
                self.works = None
                if self.done.locked():  # (else the break's wake released it, and the caller has not taken it yet)
                    self.done.release()

    def wake(self) -> None:
        """The break: the caller stops waiting for this wait (done, unless it already ended)."""
        with self._mu:
            if not self.finished and not self.left and self.done.locked():
                self.done.release()

    def leave(self) -> bool:
        """After a wake: True when the wait was still under way (this waiter is left to finish it and end),
        False when it had ended (its result counts; the waiter is idle again)."""
        with self._mu:
            if self.finished:
                if not self.done.locked():  # (the thread's release and the wake's: one of them counted)
                    self.done.acquire()
                return False
            self.left = True
            return True


_idle: list[_Waiter] = []  # waiters free for the next wait (list.pop/append: atomic)


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
        self.broken = False  # interrupt_group ran: every breakable wait on the group ends (wait)
        self.waits: set[_Waiter] = set()  # the breakable waits under way (interrupt_group wakes them)

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

    def wait(self, works: list, what: str) -> None:
        """``w.wait()`` for each of ``works`` in order (torch point-to-point Works of this group, no
        time-out; several in one handoff: p2p.waitall), breakable where waits are (:func:`breakable`:
        an elastic rank): the wait then also ends, with PeerLostError, once
        :func:`interrupt_group` has broken the group, even where shutting the group's sockets down
        (elastic/sockets.sever) did not end it: Gloo wakes a send or receive whose message has not begun
        when its connection ends, but not one whose message was under way (part of it read or written: a
        link cut mid-transfer, no RST), which waited for the group's time-out. Costs one handoff to an
        idle waiter thread and back (docs/fault_tolerance.md gives the numbers)."""
        if self.broken:
            raise PeerLostError(f"{what}: the group was broken (a member was lost: elastic)")
        try:
            w = _idle.pop()
        except IndexError:
            w = _Waiter()
        self.waits.add(w)
        w.start(works)
        if self.broken:  # (interrupt_group may have looked at waits just before the add)
            w.wake()
        w.done.acquire()
        self.waits.discard(w)
        if self.broken and w.leave():
            raise PeerLostError(f"{what}: the group was broken while this call waited (a member was lost: "
                                f"elastic)")
        err = w.error
        w.error = None
        _idle.append(w)
        if err is not None:
            raise err

    def break_waits(self) -> None:
        """End this rank's breakable waits on the group, under way and to come, with PeerLostError
        (:func:`interrupt_group`'s part on torch's Works)."""
        self.broken = True
        for w in list(self.waits):
            w.wake()

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
    """End every wait on ``group`` at once: the group is over (an elastic job's epoch that lost a
    member). Safe from another thread while a call of the group blocks. The waits on its transport end
    on this rank and on its peers where the transport has ``interrupt`` (shm: every mapped segment's
    ABORT line); this rank's breakable waits on torch point-to-point Works end too, with PeerLostError
    (GroupState.wait: Gloo has no abort, and a message cut off mid-transfer is not woken by shutting its
    socket down). Builds nothing: False when the group has no state yet (no call of it ran here, so
    nothing waits on it), else True. The group cannot be used afterwards."""
    if group is None:
        if not dist.is_initialized():
            return False
        group = dist.group.WORLD
    st = _states.get(group)
    if st is None:
        return False
    st.break_waits()
    fn = getattr(st._transport, "interrupt", None)
    if fn is not None:
        fn()
    return True


def interrupt_all() -> None:
    """:func:`interrupt_group` for every group with state here (an elastic epoch's groups end together)."""
    with _states_lock:
        groups = list(_states)
    for g in groups:
        interrupt_group(g)


def close_all() -> None:
    """Free every group's transport (``distrain.runtime.shutdown`` calls it)."""
    with _states_lock:
        states = list(_states.values())
        _states.clear()
    for st in states:
        st.close()
