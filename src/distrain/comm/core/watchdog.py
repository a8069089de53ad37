"""Collective watchdog: a rank blocked in one communication call too long stops the job and
says which ranks did not arrive.

Like torch's ``monitored_barrier`` and Horovod's stall inspector, but always on and cheap:
the dispatcher (api.py) brackets every *blocking* call (a synchronous collective, or
``wait()`` on an async handle) with :func:`blocking`, which only writes three fields of this
process's :class:`Watchdog`. A daemon thread, every ``interval`` seconds, publishes a
heartbeat ``{calls, op, blocked_s, t}`` to the rendezvous store under ``wd/<rank>`` and
checks whether the current blocking call is older than ``timeout``. If it is, the thread
reads every rank's heartbeat and classifies the others:

* *waiting*: blocked in a call too (same job, same symptom);
* *busy*: alive (fresh heartbeat) but not in a communication call: a slow step, an infinite
  loop, or a rank that skipped the collective;
* *not responding*: heartbeat older than ``STALE`` intervals: stopped (SIGSTOP), frozen, or
  dead.

An elastic rank also hands the thread an ``interrupt(blocked_s)`` it calls every interval (0 when
not in a call): the membership layer checks there whether its epoch has lost a member and, if so,
breaks the group's connections so that a call that cannot complete fails at once (elastic/member.py).

The report names the hung ranks, the call, and the flag to raise (``--collective-timeout``),
is handed to ``report`` (spawn: to the parent over the result pipe; otherwise stderr), and
the process exits. The backend's own time-out is set longer (runtime.init), so the watchdog
speaks first. ``timeout`` is per call: a run of any length is fine as long as every
collective completes.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from typing import Callable, Iterator

STALE = 2.5  # heartbeats older than this many intervals: the rank is not responding
JOIN_S = 10.0  # uninstall waits this long for a heartbeat in flight (one store.set) to come back
FLAG = "--collective-timeout"
_active: "Watchdog | None" = None


class Watchdog:
    def __init__(self, store, rank: int, world: int, timeout: float, report: Callable[[str], None],
                 interval: float | None = None, interrupt: Callable[[float], None] | None = None):
        self.store, self.rank, self.world, self.timeout, self.report = store, rank, world, timeout, report
        self.interval = interval or max(0.2, min(5.0, timeout / 4))
        self.interrupt = interrupt
        self.calls = 0  # blocking calls entered so far
        self.op: str | None = None  # the blocking call in progress
        self.since = 0.0  # time.monotonic() when it began
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distrain-watchdog", daemon=True)

    # -- the hot path: called by the dispatcher ----------------------------------------------
    def enter(self, op: str) -> None:
        self.calls += 1
        self.op, self.since = op, time.monotonic()

    def leave(self) -> None:
        self.op = None

    def withdraw(self) -> None:
        """Leave a call that was handed on before it waited (the compiled fast path declined it and the
        dispatcher, which enters it again, runs it): it does not count, so the count stays one per call."""
        self.calls -= 1
        self.op = None

    # -- the thread ---------------------------------------------------------------------------
    def _beat(self) -> None:
        blocked = time.monotonic() - self.since if self.op is not None else 0.0
        self.store.set(f"wd/{self.rank}", json.dumps(
            {"calls": self.calls, "op": self.op, "blocked_s": blocked, "t": time.time()}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                return
            op, since = self.op, self.since
            if self.interrupt is not None:
                try:
                    self.interrupt(time.monotonic() - since if op is not None else 0.0)
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                    return
            if op is not None and time.monotonic() - since > self.timeout:
                time.sleep(1.5 * self.interval)  # let every rank publish a fresh heartbeat
                if self.op is op and self.since == since:  # still the same call
                    self.report(self._diagnose(op, time.monotonic() - since))
                    os._exit(1)

    def _diagnose(self, op: str, waited: float) -> str:
        now = time.time()
        waiting, busy, silent = [], [], []
        for r in range(self.world):
            if r == self.rank:
                continue
            try:
                hb = json.loads(self.store.get(f"wd/{r}")) if self.store.check([f"wd/{r}"]) else None
            except Exception:  # noqa: BLE001
                hb = None
            if hb is None or now - hb["t"] > STALE * self.interval:
                age = f"{now - hb['t']:.0f}s" if hb else "ever"
                silent.append(f"rank {r} not responding (no heartbeat for {age}: stopped, frozen or dead)")
            elif hb["op"] is None:
                busy.append(f"rank {r} busy outside communication after {hb['calls']} calls (a slow step, a loop, "
                            f"or it skipped this collective)")
            else:
                waiting.append(f"rank {r} in {hb['op']} for {hb['blocked_s']:.0f}s")
        hung = silent + busy
        head = (f"collective time-out: rank {self.rank} waited {waited:.0f}s in {op} (its call #{self.calls}); "
                + (f"{len(hung)} rank(s) did not arrive: {'; '.join(hung)}" if hung else
                   "every rank is blocked in a call, so they called different collectives (a mismatch: rerun with "
                   "DISTRAIN_DEBUG=1 to name the rank)")
                + (f"; waiting too: {', '.join(waiting)}" if waiting and hung else ""))
        return head + f". If a step legitimately takes longer, raise {FLAG} (now {self.timeout:g}s)"

    def start(self) -> "Watchdog":
        self._beat()
        self._thread.start()
        return self

    def stop(self, join_s: float = JOIN_S) -> None:
        """Stop the thread and wait (at most ``join_s``) until it has ended.

        Waiting matters at interpreter exit: a daemon thread that comes back from a C++ call
        (store.set releases the GIL) after finalization began is ended by CPython with
        pthread_exit, whose unwinding through pybind11's noexcept GIL guard calls
        std::terminate ("terminate called without an active exception", SIGABRT)."""
        self._stop.set()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
            self._thread.join(join_s)


def to_stderr(message: str) -> None:
    print(f"distrain: error: {message}", file=sys.stderr, flush=True)


def install(store, rank: int, world: int, timeout: float, report: Callable[[str], None] | None = None,
            interval: float | None = None, interrupt: Callable[[float], None] | None = None) -> Watchdog:
    """Start this process's watchdog (replacing any previous one); ``report`` defaults to stderr;
    ``interval``: seconds between heartbeats (default from ``timeout``); ``interrupt``: see the
    module docstring."""
    global _active
    uninstall()
    _active = Watchdog(store, rank, world, timeout, report or to_stderr, interval, interrupt).start()
    return _active


def uninstall() -> None:
    """Stop this process's watchdog and wait for its thread to end (see :meth:`Watchdog.stop`)."""
    global _active
    if _active is not None:
        _active.stop()
        _active = None


def current() -> Watchdog | None:
    """The watchdog installed in this process, or None."""
    return _active


@contextlib.contextmanager
def blocking(op: str) -> Iterator[None]:
    """Bracket one blocking communication call (a no-op without a watchdog)."""
    wd = _active
    if wd is None:
        yield
        return
    wd.enter(op)
    try:
        yield
    finally:
        wd.leave()
