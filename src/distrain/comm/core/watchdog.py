"""Collective watchdog: a rank blocked in one communication call too long stops the job and
says which ranks did not arrive; in a fixed job, a rank whose process is stopped or gone is named
within two seconds.

Like torch's ``monitored_barrier`` and Horovod's stall inspector, but always on and cheap:
the dispatcher (dispatch.py) brackets every *blocking* call (a synchronous collective, or
``wait()`` on an async handle) with :meth:`Watchdog.enter` / :meth:`Watchdog.leave`, which only
write four fields of this process's :class:`Watchdog` (the call's description, its sequence
number in its group, the time, a count). A daemon thread, every ``interval`` seconds, publishes a
heartbeat ``{n, calls, op, seq, blocked_s, t}`` to the rendezvous store under ``wd/<rank>`` and
checks whether the current blocking call is older than ``timeout``. If it is, the thread
reads every rank's heartbeat and classifies the others:

* *waiting*: blocked in a call too (same job, same symptom);
* *busy*: alive (fresh heartbeat) but not in a communication call: a slow step, an infinite
  loop, or a rank that skipped the collective;
* *not responding*: no fresh heartbeat: stopped (SIGSTOP), frozen, dead, or cut off from the
  store.

Early naming (``quiet_s``, a fixed job's: runtime.init): while this rank is blocked in a call, the
thread also reads the others' heartbeats every interval (from the first interval past
``interval / 2`` in the call) and notes, on this rank's own clock, since when each one's beat
counter ``n`` has not moved (no clock is compared across hosts). Once some rank's has not moved for
``quiet_s``, this rank has been blocked that long, and that rank is seen stopped, gone or cut off, it
reports at once, through the same path as the time-out, naming the call and its sequence number.
Seen how: the heartbeat carries the process's pid, start time, boot id and PID namespace, so a process
of the same kernel and namespace is looked up in /proc (process.py: stopped or gone); and it
carries the address of a listener the rank's kernel answers (reach.py), so a rank quiet for
``quiet_s - reach.PROBE_S`` has its host probed with a few connections, spread over the probe's first
beats: none completing within ``reach.PROBE_S`` of the first means its link or host is down, a reset
means its process is gone. A quiet rank whose
process is alive and whose host answers (a starved CPU, a GIL held in a long C call) is left to the
time-out: a heartbeat that stops is not proof by itself. A rank that is busy (fresh heartbeats, not
in a call) is never named early: the time-out governs it, a long step is legitimate. With
``interval`` 0.25 s and ``quiet_s`` 1.25 s a stopped or cut-off rank is named at most
``interval + quiet_s`` = 1.5 s (plus scheduling delay) after the first call that waits on it. In
this mode the thread talks to the store over its own connection (``connect``): a store client
serializes its calls, so a main thread waiting on a key would otherwise hold the heartbeats up and
get its rank named; a failed beat or read is not fatal (the connection is made again next beat), and
a rank cut off from the store stops beating (its process alive: named by the time-out).

An elastic rank also hands the thread an ``interrupt(blocked_s)`` it calls every interval (0 when
not in a call): the membership layer checks there whether its epoch has lost a member and, if so,
breaks the group's connections so that a call that cannot complete fails at once (elastic/member.py).
Elastic ranks do not name early (their membership layer handles a lost member).

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

from distrain.comm.core import process, reach

STALE = 2.5  # without early naming: heartbeats older than this many intervals: the rank is not responding
BEAT_S = 0.25  # a fixed job's heartbeat interval (runtime.init)
QUIET_S = 1.25  # a fixed job names a rank whose heartbeat has not moved this long while this rank waits on a call
STORE_S = 2.0  # the time-out of the watchdog's own store connection (connect, reads)
JOIN_S = 10.0  # uninstall waits this long for a heartbeat in flight (one store.set) to come back
FLAG = "--collective-timeout"
_active: "Watchdog | None" = None


class Watchdog:
    def __init__(self, store, rank: int, world: int, timeout: float, report: Callable[[str], None],
                 interval: float | None = None, interrupt: Callable[[float], None] | None = None,
                 quiet_s: float | None = None, connect: Callable[[], object] | None = None, prefix: str = "",
                 listen: str | None = None):
        self.store, self.rank, self.world, self.timeout, self.report = store, rank, world, timeout, report
        self.interval = interval or max(0.2, min(5.0, timeout / 4))
        self.interrupt = interrupt
        self.quiet_s = quiet_s  # early naming on (a fixed job) when set
        self.identity = process.identity()  # (made here, in the rank: a fork server's would name the server)
        # early naming: a listener the kernel answers for this rank, so a waiting peer can tell a cut link from a
        # starved process (reach.py); its address rides in every heartbeat
        self._listener = reach.listen(listen) if quiet_s is not None else None
        if self._listener is not None:
            self.identity["probe"] = list(self._listener.address)
        self._prober = reach.Prober()  # the probes of quiet ranks' hosts
        self.stale_s = quiet_s if quiet_s is not None else STALE * self.interval  # the time-out's "not responding"
        self.connect = connect  # the thread's own store connection (None: ``store``)
        self.prefix = prefix  # the heartbeats' keys: prefix + "wd/<rank>"
        self.calls = 0  # blocking calls entered so far
        self.op: str | None = None  # the blocking call in progress
        self.seq: int | None = None  # its sequence number in its group (None: not a group's call)
        self.since = 0.0  # time.monotonic() when it began
        self.beats = 0  # heartbeats published
        self._own = None  # the connection made by ``connect`` (the thread's; None: to be made)
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its beat count, monotonic time first read)
        self._last: dict[int, dict | None] = {}  # the heartbeats read last (early naming)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="distrain-watchdog", daemon=True)

    # -- the hot path: called by the dispatcher ----------------------------------------------
    def enter(self, op: str, seq: int | None = None) -> None:
        self.calls += 1
        self.seq = seq
        self.op, self.since = op, time.monotonic()

    def leave(self) -> None:
        self.op = None

    def withdraw(self) -> None:
        """Leave a call that was handed on before it waited (the compiled fast path declined it and the
        dispatcher, which enters it again, runs it): it does not count, so the count stays one per call."""
        self.calls -= 1
        self.op = None

    # -- the thread ---------------------------------------------------------------------------
    def _store(self):
        """The store the thread talks to: its own connection when it has ``connect`` (made on first use)."""
        if self.connect is None:
            return self.store
        if self._own is None:
            self._own = self.connect()
        return self._own

    def _beat(self) -> None:
        op, seq, since = self.op, self.seq, self.since
        blocked = time.monotonic() - since if op is not None else 0.0
        self.beats += 1
        self._store().set(f"{self.prefix}wd/{self.rank}", json.dumps(
            {"n": self.beats, "calls": self.calls, "op": op, "seq": seq, "blocked_s": blocked, "t": time.time(),
             **self.identity}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            if self._listener is not None:
                self._listener.drain()
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - a beat that fails
                if self.quiet_s is None:
                    return  # (elastic) the store is gone: the job is ending anyway
                self._own = None  # not fatal: connect again next beat; the others see this rank go quiet
            op, since, seq = self.op, self.since, self.seq
            if self.interrupt is not None:
                try:
                    self.interrupt(time.monotonic() - since if op is not None else 0.0)
                except Exception:  # noqa: BLE001 - the store is gone: the job is ending anyway
                    return
            if op is None:
                continue
            blocked = time.monotonic() - since
            if self.quiet_s is not None and blocked >= self.interval / 2:
                quiet = self._quiet()
                blocked = time.monotonic() - since
                if quiet and blocked >= self.quiet_s and self.op is op and self.since == since:
                    self.report(self._diagnose(op, seq, blocked, quiet))
                    os._exit(1)
            if blocked > self.timeout:
                time.sleep(1.5 * self.interval)  # let every rank publish a fresh heartbeat
                if self.op is op and self.since == since:  # still the same call
                    self.report(self._diagnose(op, seq, time.monotonic() - since))
                    os._exit(1)

    def _read(self) -> dict[int, dict | None]:
        """Every other rank's last heartbeat (None: none, or not one of ours). Raises when the store fails."""
        others = [r for r in range(self.world) if r != self.rank]
        keys = [f"{self.prefix}wd/{r}" for r in others]
        store = self._store()
        if self.connect is None:  # key by key, a failed read a missing heartbeat (any store: an elastic one too)
            return {r: _get(store, k) for r, k in zip(others, keys)}
        if store.check(keys):  # one round trip for all (a TCPStore)
            values = store.multi_get(keys)
        else:  # (at start-up: a rank that has not beaten yet)
            values = [store.get(k) if store.check([k]) else None for k in keys]
        return {r: _record(v) for r, v in zip(others, values)}

    def _quiet(self) -> dict[int, tuple[float, str]]:
        """The ranks whose heartbeat has not moved for ``quiet_s`` on this rank's clock and that are seen
        stopped, gone or cut off -> (for how long, why)."""
        try:
            beats = self._read()
        except Exception:  # noqa: BLE001 - not fatal: read again next beat (connecting again)
            self._own = None
            return {}
        now, quiet = time.monotonic(), {}
        for r, hb in beats.items():
            n = hb["n"] if hb is not None else -1
            seen = self._seen.get(r)
            if seen is None or seen[0] != n:
                self._seen[r] = seen = (n, now)
                self._prober.forget(r)  # it beat: any probe of its host belongs to an earlier silence
            why = self._why(r, hb, now - seen[1], now)
            if now - seen[1] >= self.quiet_s and why is not None:
                quiet[r] = (now - seen[1], why)
        self._last = beats
        return quiet

    def _why(self, r: int, hb: dict | None, silent: float, now: float) -> str | None:
        """Why quiet rank ``r`` is not coming (None: no proof yet): its process seen stopped or gone in /proc,
        or its host refusing or not answering a connection (a probe made while it was quiet, reach.py)."""
        if silent < self.quiet_s - reach.PROBE_S:  # (it beat lately: no /proc read, no probe)
            return None
        if process.state(hb, self.identity) in ("stopped", "gone"):
            return WHY
        address = reach.address_of(hb)
        return self._prober.verdict(r, address, now) if address is not None else None

    def _diagnose(self, op: str, seq: int | None, waited: float,
                  quiet: dict[int, tuple[float, str]] | None = None) -> str:
        """The one-line report: with ``quiet`` (early naming) the ranks gone quiet are the ones not
        responding and the others are classified from the heartbeats just read; without, from a fresh
        read, a heartbeat older than ``stale_s`` by the clocks' time."""
        now = time.time()
        waiting, busy, silent = [], [], []
        if quiet is None:
            try:
                beats = self._read()
            except Exception:  # noqa: BLE001 - the store does not answer: nobody's heartbeat is known
                beats = {r: None for r in range(self.world) if r != self.rank}
        else:
            beats = self._last
        for r, hb in sorted(beats.items()):
            if quiet is not None and r in quiet:
                silent.append(f"rank {r} not responding (no heartbeat for {quiet[r][0]:.1f}s: {quiet[r][1]})")
            elif quiet is None and (hb is None or now - hb["t"] > self.stale_s):
                age = f"{now - hb['t']:.0f}s" if hb else "ever"
                silent.append(f"rank {r} not responding (no heartbeat for {age}: {WHY})")
            elif hb is None:
                continue  # (early naming: no heartbeat yet, but not quiet for long: say nothing of it)
            elif hb["op"] is None:
                busy.append(f"rank {r} busy outside communication after {hb['calls']} calls (a slow step, a loop, "
                            f"or it skipped this collective)")
            else:
                at = f" (seq {hb['seq']})" if isinstance(hb.get("seq"), int) else ""
                waiting.append(f"rank {r} in {hb['op']}{at} for {hb['blocked_s']:.0f}s")
        hung = silent + busy
        call = f"{op} ({'' if seq is None else f'seq {seq} in its group, '}its call #{self.calls})"
        tail = (f"; waiting too: {', '.join(waiting)}" if waiting and hung else "")
        if quiet is not None:
            return (f"rank(s) not responding: rank {self.rank} waited {waited:.2f}s in {call}; {len(hung)} rank(s) "
                    f"did not arrive: {'; '.join(hung)}{tail}. Named from the heartbeats (every {self.interval:g}s), "
                    f"before {FLAG} (now {self.timeout:g}s)")
        head = (f"collective time-out: rank {self.rank} waited {waited:.0f}s in {call}; "
                + (f"{len(hung)} rank(s) did not arrive: {'; '.join(hung)}" if hung else
                   "every rank is blocked in a call, so they called different collectives (a mismatch: rerun with "
                   "DISTRAIN_DEBUG=1 to name the rank)")
                + tail)
        return head + f". If a step legitimately takes longer, raise {FLAG} (now {self.timeout:g}s)"

    def start(self) -> "Watchdog":
        try:
            self._beat()
        except Exception:  # noqa: BLE001 - without early naming a store that fails here is an error
            if self.quiet_s is None:
                raise
            self._own = None  # (the thread connects again at its first beat)
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
        self._prober.close()
        if self._listener is not None:
            self._listener.close()


WHY = "stopped, frozen, dead or cut off"  # what a rank without heartbeats may be


def _get(store, key: str) -> dict | None:
    try:
        return _record(store.get(key)) if store.check([key]) else None
    except Exception:  # noqa: BLE001 - unreadable: no heartbeat known
        return None


def _record(value) -> dict | None:
    """A heartbeat read from the store, checked (the store is outside this process): None when it is not one."""
    try:
        hb = json.loads(value)
    except (TypeError, ValueError):
        return None
    if not isinstance(hb, dict):
        return None
    kinds = {"n": int, "calls": int, "blocked_s": (int, float), "t": (int, float)}
    if any(not isinstance(hb.get(k), t) or isinstance(hb.get(k), bool) for k, t in kinds.items()):
        return None
    if not (hb.get("op") is None or isinstance(hb["op"], str)):
        return None
    return hb


def to_stderr(message: str) -> None:
    print(f"distrain: error: {message}", file=sys.stderr, flush=True)


def install(store, rank: int, world: int, timeout: float, report: Callable[[str], None] | None = None,
            interval: float | None = None, interrupt: Callable[[float], None] | None = None,
            quiet_s: float | None = None, connect: Callable[[], object] | None = None, prefix: str = "",
            listen: str | None = None) -> Watchdog:
    """Start this process's watchdog (replacing any previous one); ``report`` defaults to stderr;
    ``interval``: seconds between heartbeats (default from ``timeout``); ``interrupt``: see the
    module docstring; ``quiet_s``: name a rank whose heartbeat has not moved this long while this
    rank waits on a call (early naming, a fixed job's); ``connect``: makes the thread's own
    connection to the store (then every heartbeat goes through it; early naming wants one); ``prefix``:
    the heartbeats' keys are ``prefix + "wd/<rank>"``; ``listen``: with early naming, the address this rank's
    kernel answers probes on (reach.py), so that a waiting peer tells a cut link from a starved rank."""
    global _active
    uninstall()
    _active = Watchdog(store, rank, world, timeout, report or to_stderr, interval, interrupt, quiet_s, connect,
                       prefix, listen).start()
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
def blocking(op: str, seq: int | None = None) -> Iterator[None]:
    """Bracket one blocking communication call, ``seq`` its sequence number in its group (a no-op
    without a watchdog)."""
    wd = _active
    if wd is None:
        yield
        return
    wd.enter(op, seq)
    try:
        yield
    finally:
        wd.leave()
