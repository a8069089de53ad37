"""Point-to-point through the compiled data plane: the extension's byte rings (_dataplane.cpp's
``Rings``) under p2p.Channels, when its transport's kernels are "compiled" (compiled.kernels()).

The same protocol as p2p.py's Python engine, byte for byte, with the copies and head/tail accesses
done by the extension, so a compiled rank and a Python rank can talk to each other. Three things
change, never the semantics:

* the engine's inner loops copy through ``Rings.push/header/pull`` (:func:`push`, :func:`pull`:
  one call per message piece);
* an ``isend`` with nothing queued before it on its channel writes what fits at once
  (:func:`send_at_once`), and is complete when the whole message fitted; what did not fit, like an
  ``irecv``, is left to a wait (no progress call when posting);
* waiting on a handle first tries the whole transfer in one C++ call with the GIL released
  (:func:`finish`): a send that is the only one pending, or the receive that the next message from
  its peer goes to (the oldest posted of its (peer, tag), nothing else pending to send). The call
  waits only while the Python engine would have nothing else to do, and hands back its progress
  otherwise; why that cannot deadlock is said in _dataplane.cpp ("Point-to-point"). Anything else
  (a stashed message, another tag first, several messages pending, a wrong size) runs the Python
  engine. ``Channels.fast_sent``/``fast_received`` count what the C++ completed.

A tensor outside CPU memory turns the group's channels to the Python copies for good
(:func:`rings_for`: the extension copies host memory); the protocol being the same, the switch may
happen anywhere.

Contract: the functions take a p2p.Channels (whose state they read and advance: ``rings``,
``known``, its queues and counters) and are called with its guard held; a failure raises the
typed errors the Python engine raises (segment.ring_error's PeerCorruptError, the transport's
PeerLostError).
"""

from __future__ import annotations

import threading

import torch

from distrain.comm.shm import compiled
from distrain.comm.shm.segment import MAX_MESSAGE, padded, ring_error


def make_rings(sh):
    """The extension's Rings for transport ``sh``'s point-to-point channels, this rank's own segment
    known (peers are added as they are opened: a pair never waits for ranks it does not talk to);
    a message header announcing more than segment.MAX_MESSAGE bytes is refused, as in Python."""
    rings = compiled.ext.Rings(sh.rank, sh.size, sh.layout.ring_bytes, sh.layout.chan_offset, float(sh.timeout),
                               threading.main_thread().ident, MAX_MESSAGE)
    add_peer(rings, sh, sh.rank)
    # The SLEEPING line counts this rank's blocked threads, C++ waits and Python waits alike: the
    # transport's Python count (a plain store until a Plane exists) would overwrite the extension's
    # atomic adds, so from now on the transport counts through the same atomic add.
    sh.count_sleepers_with(rings.sleepers)
    return rings


def add_peer(rings, sh, q: int) -> None:
    s = sh.peers[q]
    rings.add_peer(q, s.bytes.data_ptr(), s.wake_fd, compiled.lock_fd(s))


def checked(sh, rings, value: int) -> int:
    """``value`` (an offset or byte count from ``rings``), or, for BAD_WORDS, the PeerCorruptError of
    the words the Rings found invalid (segment.ring_error: what the Python engine raises for them)."""
    if value == compiled.BAD_WORDS:
        raise ring_error(sh, rings.err_peer, rings.err_out, rings.err_head, rings.err_tail,
                         rings.err_count if rings.err_header else None)
    return value


def p2p_error(sh, rc: int, q: int, what: str) -> Exception:
    """The typed error of a failed blocking send/recv of the Rings (what transport.wait raises);
    CORRUPT is :func:`checked`'s."""
    kind = {compiled.PEER_ABORTED: "aborted", compiled.PEER_DIED: "died", compiled.TIMED_OUT: "timeout"}[rc]
    return sh.lost(kind, None if kind == "timeout" else q, what, [q])


class Guard:
    """The channels' lock. A thread that finds it taken first asks a blocking compiled transfer
    holding it to hand back (``Rings.want``): that transfer may wait for a long time, and this
    thread's message may be what its peer waits for."""

    __slots__ = ("chans", "lock")

    def __init__(self, chans):
        self.chans, self.lock = chans, threading.RLock()

    def __enter__(self) -> None:
        if not self.lock.acquire(False):
            rings = self.chans.rings
            if rings is None:
                self.lock.acquire()
                return
            rings.want(1)
            try:
                self.lock.acquire()
            finally:
                rings.want(-1)

    def __exit__(self, *exc) -> None:
        self.lock.release()


def rings_for(chans, tensor: torch.Tensor):
    """The rings, or None: a tensor outside CPU memory turns them off for good (see the module
    doc), and so does a closed transport (the rings point into its unmapped segments)."""
    if chans.rings is not None and (not tensor.is_cpu or chans.sh.me is None):
        chans.rings = None
    return chans.rings


def knows(chans, q: int) -> bool:
    """Whether the rings know peer q's segment (after adding what the transport has opened)."""
    if q not in chans.known:
        add_opened_peers(chans)
    return q in chans.known


def add_opened_peers(chans) -> None:
    """Give the rings every segment the transport has opened (the engine looks at the rings of all
    of them, so must the compiled waits)."""
    if len(chans.known) != len(chans.sh.peers):
        for p in list(chans.sh.peers):
            if p not in chans.known:
                add_peer(chans.rings, chans.sh, p)
                chans.known.add(p)


def send_at_once(chans, rings, q: int, m) -> bool:
    """An isend's first try, nothing queued before it on its channel: write what fits of message
    ``m`` to peer q now; whether all of it fitted (the send is then complete)."""
    m.off = checked(chans.sh, rings, rings.push(q, m.tag, m.data, -1))
    chans.sh.unlink_if_all_opened()
    if m.off == m.total:
        chans.fast_sent += 1
        return True
    return False


def push(chans, q: int, pending) -> None:
    """The engine's push to peer q with the extension's copies: write the pending messages in order
    as far as the ring has room; each that is written whole is done."""
    rings = chans.rings
    while pending and knows(chans, q):
        m = pending[0]
        m.off = checked(chans.sh, rings, rings.push(q, m.tag, m.data, m.off))
        if m.off != m.total:
            return
        pending.popleft()
        m.work.done = True


def pull(chans, q: int) -> None:
    """The engine's pull from peer q with the extension's copies (the same steps as the Python
    pull): read headers and bytes while they are there, each message to the receive it matches."""
    if not knows(chans, q):
        return
    rings = chans.rings
    while True:
        cur = chans.current.get(q)
        if cur is None:
            h = rings.header(q)
            if h is None:
                return
            tag, n = h
            checked(chans.sh, rings, n)
            m = chans.match(q, tag, n)
            if n == 0:
                chans.complete(m)
                continue
            cur = (m, 0, padded(n))
        m, off, total = cur
        off = checked(chans.sh, rings, rings.pull(q, m.data, off, total))
        if off == total:
            chans.current.pop(q, None)
            chans.complete(m)
        else:
            chans.current[q] = (m, off, total)
            return


def finish(chans, w) -> None:
    """Finish handle ``w`` in one call of the extension if the Python engine has nothing else to do:
    a send that is the only message pending, or the receive that the next message from its peer goes
    to, with no send pending. Whatever the call did not finish (it hands back when something else
    needs this rank, see _dataplane.cpp) stays recorded for the engine."""
    sh = chans.sh
    with chans.guard:
        rings, q, m = chans.rings, w.peer, w.op
        if w.done or rings is None or sh.me is None or not knows(chans, q):
            return
        add_opened_peers(chans)  # the call watches every ring the engine would drain
        if w.send:
            pending = chans.sends.get(q)
            if not pending or pending[0] is not m or sum(map(len, chans.sends.values())) != 1:
                return
            rc, m.off = rings.send(q, m.tag, m.data, m.off)
            if rc == compiled.OK:
                pending.popleft()
                w.done = True
                chans.fast_sent += 1
        else:
            cur = chans.current.get(q)
            if cur is None:
                posted = chans.posted.get((q, m.tag))
                if not posted or posted[0] is not m:
                    return
            elif cur[0] is not m:
                return
            if any(chans.sends.values()):
                return
            rc, off = rings.recv(q, m.tag, m.data, -1 if cur is None else cur[1])
            if off >= 0:  # its header is read: the message is this receive's
                if cur is None:
                    posted.popleft()
                chans.current[q] = (m, off, padded(m.data.numel()))
            if rc == compiled.OK:
                del chans.current[q]
                w.done = True
                chans.fast_received += 1
        sh.unlink_if_all_opened()  # as progress() does: the peer that sent has mapped this rank's segment
        if rc == compiled.CORRUPT:
            checked(sh, rings, compiled.BAD_WORDS)
        if rc not in (compiled.OK, compiled.UNSUPPORTED):
            raise p2p_error(sh, rc, rings.err_peer, w.desc)
