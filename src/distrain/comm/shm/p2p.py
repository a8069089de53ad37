"""Point-to-point over shared memory: one byte ring per ordered pair of ranks.

The ring for messages from rank s to rank d lives in s's segment (ring d). s alone writes
its bytes and its *head* (bytes written so far); d alone advances its *tail* (bytes read
so far): a single-producer single-consumer queue, free space = size - (head - tail).
A message is a 16-byte header [tag, nbytes] followed by its bytes, padded to 16, so a
header never straddles the end of the ring. Large messages stream through in pieces.

Contract of the Transport (what star/ring/tree rely on): messages between one pair with
one tag arrive in the order they were posted. The receiver matches each arriving message
to the oldest posted ``irecv`` of that (peer, tag); a message that nobody waits for yet is
copied aside (``stash``) and handed to the next matching ``irecv``, so other tags never
block it. There is no background thread: whichever thread waits on any handle drives
progress for all channels of the group (both directions), so two ranks sending to each
other before receiving cannot deadlock. Visibility: data is written before the head that
covers it, read after the head that covers it (see transport.py).

Words a peer can write are data: heads and tails are checked (segment.words_ok) before they index
a ring, a header's byte count (at most this host's memory) before anything is allocated for it; both
kernels raise segment.ring_error's PeerCorruptError for the same words.

Compiled kernels (compiled.kernels() == "compiled"): the same protocol, byte for byte, the
extension's byte rings doing the copies and head/tail accesses (compiled_p2p.py: what changes,
never the semantics), so a compiled rank and a Python rank can talk to each other. The engine here
stays the reference and runs whatever the compiled path does not take.
"""

from __future__ import annotations

from collections import deque

import torch

from distrain.comm.shm import compiled_p2p
from distrain.comm.shm.compiled_p2p import Guard
from distrain.comm.shm.segment import HEADER, MAX_MESSAGE, padded, ring_error, words_ok
from distrain.errors import CommError


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class ShmWork:
    """Handle of one shared-memory isend/irecv."""

    def __init__(self, chans: "Channels", send: bool, peer: int, tag: int):
        self.chans, self.send, self.peer, self.tag = chans, send, peer, tag
        self.done = False
        self.error: str | None = None
        self.op: _Send | _Recv | None = None  # the message it waits for

    @property
    def desc(self) -> str:  # built when needed: a message's handle is made on the hot path
        sh = self.chans.sh
        if self.send:
            return f"isend from rank {sh.me_global} to rank {sh.ranks[self.peer]} (tag {self.tag})"
        return f"irecv on rank {sh.me_global} from rank {sh.ranks[self.peer]} (tag {self.tag})"

    def wait(self, timeout=None) -> bool:
        self.chans.wait(self)
        return True

    def is_completed(self) -> bool:
        if not self.done:
            self.chans.progress()
        return self.done


class _Send:
    def __init__(self, work: ShmWork, data: torch.Tensor, tag: int):
        self.work, self.data, self.tag = work, data, tag
        self.total = padded(data.numel())
        self.off = -1  # -1: header not written yet


class _Recv:
    def __init__(self, work: ShmWork | None, data: torch.Tensor | None, tag: int):
        self.work, self.data, self.tag = work, data, tag  # work None: stashed (nobody waits yet)
        self.complete = False
        self.waiter: _Recv | None = None  # an irecv that took this stashed message while it streamed


class Channels:
    """All shared-memory P2P channels of one group, seen from this rank."""

    def __init__(self, sh):
        self.sh = sh
        self.R = sh.layout.ring_bytes
        self.guard = Guard(self)
        self.sends: dict[int, deque[_Send]] = {}
        self.posted: dict[tuple[int, int], deque[_Recv]] = {}
        self.stash: dict[tuple[int, int], deque[_Recv]] = {}
        self.current: dict[int, tuple[_Recv, int, int]] = {}  # peer -> (message, bytes read, padded size)
        self.rings = compiled_p2p.make_rings(sh) if sh.kernels == "compiled" else None  # None: Python copies
        self.known = {sh.rank}  # the peers whose segment the rings know
        self.fast_sent = self.fast_received = 0  # messages the compiled path completed (tests check it)

    # -- posting -------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, q: int, tag: int) -> ShmWork:
        w = ShmWork(self, True, q, tag)
        m = w.op = _Send(w, _bytes(tensor), tag)
        with self.guard:
            pending = self.sends.setdefault(q, deque())
            rings = compiled_p2p.rings_for(self, tensor)
            if rings is not None and not pending and compiled_p2p.knows(self, q) and \
                    compiled_p2p.send_at_once(self, rings, q, m):
                w.done = True
                return w
            pending.append(m)
            if rings is not None:
                return w  # the rest waits for a wait (in one C++ call when nothing else is pending)
            self.progress()
        return w

    def irecv(self, tensor: torch.Tensor, q: int, tag: int) -> ShmWork:
        w = ShmWork(self, False, q, tag)
        r = w.op = _Recv(w, _bytes(tensor), tag)
        with self.guard:
            rings = compiled_p2p.rings_for(self, tensor)
            stashed = self.stash.get((q, tag))
            if stashed:
                m = stashed.popleft()
                if m.complete:
                    self._deliver(r, m.data)
                else:
                    m.waiter = r
            else:
                self.posted.setdefault((q, tag), deque()).append(r)
                if rings is not None:
                    return w  # the wait moves it (in one C++ call when nothing else is pending)
            self.progress()
        return w

    def _deliver(self, r: _Recv, data: torch.Tensor) -> None:
        if data.numel() != r.data.numel():
            r.work.error = (f"{r.work.desc}: the message has {data.numel()} bytes but the receiving tensor "
                            f"has {r.data.numel()}; sender and receiver must agree on the size")
        else:
            r.data.copy_(data)
        r.work.done = True

    # -- progress ------------------------------------------------------------------------
    def progress(self) -> None:
        self.sh.unlink_if_all_opened()
        with self.guard:
            for q, pending in self.sends.items():
                if pending:
                    self._push(q, pending)
            for q, s in list(self.sh.peers.items()):
                if q != self.sh.rank:
                    self._pull(q, s)

    def _push(self, q: int, pending: deque) -> None:
        if self.rings is not None:
            compiled_p2p.push(self, q, pending)
            return
        me = self.sh.me
        head_line, tail_line = me.layout.head_line(q), me.layout.tail_line(q)
        head, tail = me.line(head_line), me.line(tail_line)
        if not words_ok(head, tail, self.R):
            raise ring_error(self.sh, q, True, head, tail)
        space = self.R - (head - tail)
        ring = me.ring(q)
        moved = False
        while pending and space > 0:
            m = pending[0]
            if m.off < 0:
                if space < HEADER:
                    break
                pos = head % self.R
                ring[pos:pos + HEADER].view(torch.int64).copy_(torch.tensor([m.tag, m.data.numel()]))
                head, space, m.off, moved = head + HEADER, space - HEADER, 0, True
                continue
            pos = head % self.R
            k = min(m.total - m.off, space, self.R - pos)
            real = min(k, m.data.numel() - m.off)
            if real > 0:
                ring[pos:pos + real].copy_(m.data[m.off:m.off + real])
            m.off, head, space, moved = m.off + k, head + k, space - k, True
            if m.off == m.total:
                pending.popleft()
                m.work.done = True
        if moved:
            me.set_line(head_line, head)  # after the bytes it covers
            self.sh.wake_peers((q,))

    def _pull(self, q: int, s) -> None:
        if self.rings is not None:
            compiled_p2p.pull(self, q)
            return
        head_line, tail_line = s.layout.head_line(self.sh.rank), s.layout.tail_line(self.sh.rank)
        head, tail = s.line(head_line), s.line(tail_line)
        if not words_ok(head, tail, self.R):
            raise ring_error(self.sh, q, False, head, tail)
        avail = head - tail
        if avail <= 0:
            return
        ring = s.ring(self.sh.rank)
        while avail > 0:
            cur = self.current.get(q)
            if cur is None:
                pos = tail % self.R
                tag, n = ring[pos:pos + HEADER].view(torch.int64).tolist()
                if not 0 <= n <= MAX_MESSAGE:
                    raise ring_error(self.sh, q, False, head, tail, n)
                tail, avail = tail + HEADER, avail - HEADER
                cur = (self.match(q, tag, n), 0, padded(n))
                if n == 0:
                    self.complete(cur[0])
                    continue
            m, off, total = cur
            pos = tail % self.R
            k = min(total - off, avail, self.R - pos)
            real = min(k, m.data.numel() - off)
            if real > 0:
                m.data[off:off + real].copy_(ring[pos:pos + real])
            off, tail, avail = off + k, tail + k, avail - k
            if off == total:
                self.current.pop(q, None)
                self.complete(m)
            else:
                self.current[q] = (m, off, total)
        s.set_line(tail_line, tail)  # after the bytes are copied out: the sender may reuse them
        self.sh.wake_peers((q,))

    def match(self, q: int, tag: int, n: int) -> _Recv:
        """Where peer q's arriving message (tag, n bytes) is read to: the oldest posted receive of its
        (peer, tag), else a buffer aside (stashed while nobody waits; for a posted receive of another
        size, reported on it once read)."""
        posted = self.posted.get((q, tag))
        if posted:
            r = posted.popleft()
            if r.data.numel() == n:
                return r
            # wrong size: read the message aside, then report it on the waiting handle
            m = _Recv(None, torch.empty(n, dtype=torch.uint8), tag)
            m.waiter = r
            return m
        m = _Recv(None, torch.empty(n, dtype=torch.uint8), tag)
        self.stash.setdefault((q, tag), deque()).append(m)
        return m

    def complete(self, m: _Recv) -> None:
        """Message ``m`` has arrived whole: its handle is done, or it is delivered to the receive
        that took it while it streamed."""
        if m.work is not None:
            m.work.done = True
            return
        m.complete = True
        if m.waiter is not None:
            self._deliver(m.waiter, m.data)

    # -- waiting -------------------------------------------------------------------------
    def wait(self, w: ShmWork) -> None:
        if not w.done and self.rings is not None:
            compiled_p2p.finish(self, w)

        def ready() -> bool:
            if not w.done:
                self.progress()
            return w.done

        if not w.done:
            self.sh.wait(ready, [w.peer], w.desc)
        if w.error:
            raise CommError(w.error)
