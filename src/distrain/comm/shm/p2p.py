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
"""

from __future__ import annotations

import threading
from collections import deque

import torch

from distrain.errors import CommError

HEADER = 16


def _pad(n: int) -> int:
    return -(-n // HEADER) * HEADER


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class ShmWork:
    """Handle of one shared-memory isend/irecv."""

    def __init__(self, chans: "Channels", desc: str, peer: int):
        self.chans, self.desc, self.peer = chans, desc, peer
        self.done = False
        self.error: str | None = None

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
        self.total = _pad(data.numel())
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
        self.lock = threading.RLock()
        self.sends: dict[int, deque[_Send]] = {}
        self.posted: dict[tuple[int, int], deque[_Recv]] = {}
        self.stash: dict[tuple[int, int], deque[_Recv]] = {}
        self.current: dict[int, tuple[_Recv, int, int]] = {}  # peer -> (message, bytes read, padded size)

    # -- posting -------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, q: int, tag: int) -> ShmWork:
        w = ShmWork(self, f"isend from rank {self.sh.me_global} to rank {self.sh.ranks[q]} (tag {tag})", q)
        with self.lock:
            self.sends.setdefault(q, deque()).append(_Send(w, _bytes(tensor), tag))
            self.progress()
        return w

    def irecv(self, tensor: torch.Tensor, q: int, tag: int) -> ShmWork:
        w = ShmWork(self, f"irecv on rank {self.sh.me_global} from rank {self.sh.ranks[q]} (tag {tag})", q)
        r = _Recv(w, _bytes(tensor), tag)
        with self.lock:
            stashed = self.stash.get((q, tag))
            if stashed:
                m = stashed.popleft()
                if m.complete:
                    self._deliver(r, m.data)
                else:
                    m.waiter = r
            else:
                self.posted.setdefault((q, tag), deque()).append(r)
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
        if not self.sh._unlinked:
            self.sh._unlink_if_all_opened()
        with self.lock:
            for q, pending in self.sends.items():
                if pending:
                    self._push(q, pending)
            for q, s in list(self.sh.peers.items()):
                if q != self.sh.rank:
                    self._pull(q, s)

    def _push(self, q: int, pending: deque) -> None:
        me = self.sh.me
        head_line, tail_line = me.layout.head_line(q), me.layout.tail_line(q)
        head = me.line(head_line)
        space = self.R - (head - me.line(tail_line))
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
        head_line, tail_line = s.layout.head_line(self.sh.rank), s.layout.tail_line(self.sh.rank)
        tail = s.line(tail_line)
        avail = s.line(head_line) - tail
        if avail <= 0:
            return
        ring = s.ring(self.sh.rank)
        while avail > 0:
            cur = self.current.get(q)
            if cur is None:
                pos = tail % self.R
                tag, n = ring[pos:pos + HEADER].view(torch.int64).tolist()
                tail, avail = tail + HEADER, avail - HEADER
                cur = (self._match(q, tag, n), 0, _pad(n))
                if n == 0:
                    self._complete(cur[0])
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
                self._complete(m)
            else:
                self.current[q] = (m, off, total)
        s.set_line(tail_line, tail)  # after the bytes are copied out: the sender may reuse them
        self.sh.wake_peers((q,))

    def _match(self, q: int, tag: int, n: int) -> _Recv:
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

    def _complete(self, m: _Recv) -> None:
        if m.work is not None:
            m.work.done = True
            return
        m.complete = True
        if m.waiter is not None:
            self._deliver(m.waiter, m.data)

    # -- waiting -------------------------------------------------------------------------
    def wait(self, w: ShmWork) -> None:
        def ready() -> bool:
            if not w.done:
                self.progress()
            return w.done

        self.sh.wait(ready, [w.peer], w.desc)
        if w.error:
            raise CommError(w.error)
