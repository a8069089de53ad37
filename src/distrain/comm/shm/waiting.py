"""How a shared-memory rank waits for its peers, and wakes them (the mixin :class:`Waits` of
transport.ShmTransport; the module docstring of transport.py says why it is safe).

Waiting never starves the other ranks of a 2-core machine: spin briefly (the peer may be running on
the other core and about to publish), then block in the kernel on this rank's wake-up pipe
(segment.py) until a peer writes to it, as a socket read would. A rank announces that it blocks
(its SLEEPING line), re-checks, and blocks; a rank that publishes a flag then writes a byte to
every peer that announced it blocks. A full fence between the store and the load on each side
(:func:`fence`) rules out the lost wake-up. Every wait honours the timeout, notices a peer that
aborted or whose process died, and raises a PeerLostError naming this rank, the collective and
the peer.

Contract of the host class: it has ``me`` (this rank's Segment), ``peers`` (group rank -> mapped
Segment), ``rank``, ``ranks``, ``me_global``, ``pids``, ``timeout``, ``spin``, ``_sleeping``,
``_sleep_lock``, ``_atomic_sleepers`` and :meth:`unlink_if_all_opened`.
"""

from __future__ import annotations

import select
import threading
import time

from distrain.comm.shm.segment import ABORT, SLEEPING
# the waits' timings (segment.py holds them: the extension is checked against them, compiled.reference)
from distrain.comm.shm.segment import CHECK_EVERY, MAX_BLOCK, SPIN_MAX_S, SPIN_MIN_S
from distrain.errors import PeerLostError

_fence_lock = threading.Lock()
_MAIN = threading.main_thread().ident  # waits on other threads (the group's worker) never spin


def fence() -> None:
    """A full memory barrier: acquiring an uncontended lock is an atomic read-modify-write
    (lock-prefixed on x86-64), which orders every earlier store before every later load."""
    _fence_lock.acquire()
    _fence_lock.release()


class Waits:
    """Waiting on peers and waking them, for a shared-memory transport (see the module docstring)."""

    def wait(self, ready, peers, what: str) -> None:
        """Poll ``ready()`` until true: spin, then block on the wake-up pipe (see the module doc).

        Raises a CommError naming this rank, ``what`` and the peer, when a peer (group ranks
        ``peers``) aborted or died, or when the timeout passes.
        """
        # Spin only as long as spinning pays off, and never hand the core away while spinning.
        # On a machine with more runnable threads than cores the peer is often not running:
        # a sched_yield then gives the core to another process for a whole time slice (4 KiB
        # all_reduce, P=2, 2 busy processes: 2.4-2.8 ms per call with a yield in the spin,
        # 0.35-0.5 ms without), and blocking (a peer's write wakes us, and the scheduler
        # favours a task that slept) is faster. A wait that ends while spinning doubles the
        # next spin, one that has to block halves it, between SPIN_MIN_S and SPIN_MAX_S.
        if ready():
            return
        # A wait on the group's worker thread (an async collective, e.g. a DDP bucket during
        # backward) blocks at once: spinning there would take the core from the rank's backward.
        spin = self.spin if threading.get_ident() == _MAIN else 0.0
        clock = time.perf_counter
        end = clock() + spin
        while True:
            for _ in range(8):
                if ready():
                    if 0 < spin < SPIN_MAX_S:
                        self.spin = min(SPIN_MAX_S, spin * 2)
                    return
            if clock() > end:
                break
        if spin:
            self.spin = max(SPIN_MIN_S, spin / 2)
        self.unlink_if_all_opened()
        start = last = time.monotonic()
        block = 1e-3
        me = self.me
        while True:
            self._sleepers(+1)
            try:
                fence()
                if ready():
                    return
                select.select([me.wake_fd], [], [], block)
                me.drain()
            finally:
                self._sleepers(-1)
            if ready():
                return
            block = min(block * 2, MAX_BLOCK)
            now = time.monotonic()
            if now - last >= CHECK_EVERY:
                last = now
                self._check_peers(peers, what, now - start)

    def count_sleepers_with(self, add) -> None:
        """From now on count this rank's blocked threads with ``add(delta)``, the extension's atomic add
        on the SLEEPING line (its Plane's or Rings'): its C++ waits count there too, and the plain store
        below would overwrite their adds."""
        self._atomic_sleepers = add

    def _sleepers(self, delta: int) -> None:
        if self._atomic_sleepers is not None:
            self._atomic_sleepers(delta)
            return
        with self._sleep_lock:
            self._sleeping += delta
            self.me.set_line(SLEEPING, self._sleeping)

    def wake_peers(self, peers=None) -> None:
        """After publishing a flag: wake the peers that block waiting for one."""
        fence()
        for q, s in list(self.peers.items()):
            if q != self.rank and (peers is None or q in peers) and s.ctrl[SLEEPING * 8]:
                s.wake()

    def _check_peers(self, peers, what: str, waited: float) -> None:
        for q in peers:
            s = self.peers.get(q)
            if s is not None and s.line(ABORT):
                raise self.lost("aborted", q, what, peers)
            if s is not None and not s.owner_alive():
                raise self.lost("died", q, what, peers)
        if waited > self.timeout:
            raise self.lost("timeout", None, what, [q for q in peers if q != self.rank])

    def lost(self, kind: str, q: int | None, what: str, peers) -> PeerLostError:
        """The error of a wait that ends without its peers (the compiled waits report the same):
        ``kind`` "aborted" (rank q failed), "died" (its process is gone) or "timeout"."""
        if kind == "aborted":
            return PeerLostError(f"{what} on rank {self.me_global}: rank {self.ranks[q]} failed during this "
                                 f"collective (shared-memory transport); see that rank's error")
        if kind == "died":
            return PeerLostError(f"{what} on rank {self.me_global}: rank {self.ranks[q]} (pid {self.pids[q]}) died "
                                 f"while this rank waited for it (shared-memory transport)")
        return PeerLostError(f"{what} on rank {self.me_global}: timed out after {self.timeout:g}s waiting for "
                             f"rank(s) {[self.ranks[p] for p in peers if p != self.rank]} (shared-memory transport); "
                             f"a rank is stuck or did not call the same collective")

    def abort(self) -> None:
        """Tell every peer that this rank failed, so their waits end at once."""
        if self.me is not None and self.me.ctrl is not None:
            self.me.set_line(ABORT, 1)
            self.wake_peers()

    def interrupt(self) -> None:
        """End every wait on this group at once, this rank's and its peers' (the group is over: an elastic
        epoch that lost a member; safe from another thread while a call blocks): the ABORT line of every
        segment this rank has mapped, its own and its peers', then a wake-up to each. A wait checks its
        peers' ABORT lines (this rank's waits, compiled or not, look at the peers' only), so each blocked
        wait ends within a block (MAX_BLOCK) with the PeerLostError "aborted" naming one of them. ABORT only
        ever goes from 0 to 1, so a second writer of that line changes nothing a reader could misread."""
        segs = [s for s in list(self.peers.values()) if s.ctrl is not None]
        for s in segs:
            s.set_line(ABORT, 1)
        fence()
        for s in segs:
            s.wake()  # (this rank's own FIFO too: its blocked wait returns from select at once)
