"""Shared-memory segments in /dev/shm: the layout of one, creating it, and opening a peer's.

Each rank of a shared-memory group creates ONE segment (a file in /dev/shm, mapped with
mmap) and publishes a record of it in the process group's store; peers open it by that record
when they first need it. The record is ``<name> <size> <host> <pid> <token>``: the token is 16
random bytes the owner also wrote into the segment (:class:`Layout`'s token line). A peer parses
the record strictly (:func:`parse_record`) and opens the file only as files.py allows (its name
fits the pattern for that rank, no link followed, fstat: a regular file of our uid, mode 0600,
the size this rank's own layout implies, then the token): a forged record or a planted file is
refused with a SegmentRefusedError, and left untouched. Names are unique per run and carry the
creator's pid (for people and tools only; nothing judges liveness by it):

    /dev/shm/distrain-<pid>-<random 8 hex>-g<group tag>-r<rank>

Cleanup, so that no run leaves files behind and no run trips over an older one's:

* a new run never reuses a name (the random part), so stale files cannot confuse it;
* a file is unlinked as soon as every peer has mapped it (the mapping outlives the name;
  each peer sets its own "opened" line in the segment), so once every pair has talked
  nothing is left on disk even if ranks are later killed with SIGKILL: the kernel frees
  the memory when the last mapping goes;
* until then, the creator unlinks it on group destroy and at process exit (atexit);
* creating a file first sweeps /dev/shm for our files whose creator no longer holds its lock
  (files.sweep_stale: left by a run killed during setup; a survivor's exit sweeps too).

Liveness of a segment's owner is its lock (files.OwnerLock): a peer that can take it is told its
owner died (:meth:`Segment.owner_alive`, and the extension's waits with the same descriptor).

Layout of a segment (offsets in bytes, every region 64-byte aligned, one writer per line)
is described in :class:`Layout`. Beside each segment a FIFO (``<name>.wake``) lets a rank
that has waited too long to keep polling block in the kernel until a peer writes a byte
(a peer does so after publishing a flag, if the rank's "sleeping" line is set).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from distrain.comm.shm import files
# SHM_DIR, new_name, sweep_stale, SegmentRefusedError: this module's API as before files.py took them over
from distrain.comm.shm.files import SHM_DIR, TOKEN_BYTES, SegmentRefusedError, new_name, sweep_stale  # noqa: F401
from distrain.errors import PeerLostError

LINE = 64  # bytes per cache line: every flag sits alone on its line (no false sharing)
_I64_PER_LINE = LINE // 8
# ctrl lines of a segment (see Layout): which line each flag lives on
ARRIVE, DONE, ABORT, PID, RESULT, SLEEPING, CONSUMED, SYMMETRIC = 0, 1, 2, 3, 4, 5, 6, 7


class PeerCorruptError(PeerLostError):
    """A peer wrote a value into shared memory that breaks the protocol (a ring's head or tail, a
    message header): it is treated as a failed peer, whichever kernels read the value."""


# The waits (transport.ShmTransport.wait, and the extension's): how long a wait spins before it blocks on
# the wake-up pipe (adapted between these two), how long one block lasts at most, how often a waiting
# rank checks for dead peers and the deadline. Seconds.
SPIN_MAX_S = 1e-3  # the longest a wait spins before it blocks on the wake-up pipe ...
SPIN_MIN_S = 5e-6  # ... and the shortest (spins that keep failing shrink to this)
MAX_BLOCK = 0.05  # seconds one block lasts at most (then the deadline and peers are checked)
CHECK_EVERY = 0.05  # seconds between checks for dead peers and the deadline

HEADER = 16  # bytes of a ring message's header (p2p.py): every head and tail is a multiple of it
WORD_LIMIT = 1 << 62  # no head reaches it (2^62 bytes sent); keeps head + ring within an int64
MAX_MESSAGE = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")  # no message is larger than the host


def padded(n: int) -> int:
    """The bytes a message of ``n`` bytes takes in a ring after its header: ``n`` padded to HEADER."""
    return -(-n // HEADER) * HEADER


def words_ok(head: int, tail: int, ring_bytes: int) -> bool:
    """Whether a ring's head and tail, as read from shared memory, index it safely: multiples of 16,
    0 <= tail <= head < WORD_LIMIT, at most a ring apart (the extension's Rings::words_ok)."""
    return not (head | tail) & (HEADER - 1) and 0 <= tail <= head < WORD_LIMIT and head - tail <= ring_bytes


def ring_error(sh, q: int, outgoing: bool, head: int, tail: int, count: int | None = None) -> PeerCorruptError:
    """The error for invalid words in the ring between this rank and group rank q of transport ``sh``
    (``outgoing``: the ring to q, in this rank's segment), or for a header's byte count ``count``;
    both kernels raise it (p2p.py)."""
    me, peer = sh.me_global, sh.ranks[q]
    ring = f"the ring from rank {me} to rank {peer}" if outgoing else f"the ring from rank {peer} to rank {me}"
    if count is not None:
        why = (f"a message header in {ring} announces {count} bytes (0 to {MAX_MESSAGE}, this host's memory, "
               f"expected)")
    else:
        why = (f"{ring} has head {head} and tail {tail} (multiples of 16 with 0 <= tail <= head < 2^62 and head - "
               f"tail <= {sh.layout.ring_bytes} expected)")
    return PeerCorruptError(f"point-to-point on rank {me}: rank {peer} wrote invalid words into shared memory: {why}; "
                            f"that rank is treated as failed (shared-memory transport)")


@dataclass(frozen=True)
class Layout:
    """Where things are inside one rank's segment, for a group of ``size`` ranks.

    ctrl lines (int64 each, written only by this segment's owner unless said otherwise):
      0 arrive: step number of the last collective step whose data this rank has written
      1 done:   step number of the last two-phase step whose reduced part is written
      2 abort:  1 once this rank has failed (peers stop waiting at once)
      3 pid of the owner
      4 result: step number whose result a host leader has written (hierarchy.py)
      5 sleeping: how many of the owner's threads block on its wake-up pipe
      6 consumed: step number up to which this rank has finished reading every peer's slots
      7 symmetric: what the owner's current all_reduce works on: 0 for its slots, else the code
                of its symmetric tensor (allocation and offset, symmetric.py)
      8 + 2q:   head of the channel to rank q (bytes written so far by the owner)
      9 + 2q:   tail of that channel (bytes read so far; written by rank q, the reader)
      8 + 2P + q: 1 once rank q has mapped this segment (written by rank q)
      8 + 3P:   the owner's token (TOKEN_BYTES), written once before the segment is published
    coll: ``slots`` buffers of ``slot_bytes`` for the direct collectives, used round robin
      (step s in slot s % slots): at least double buffering, more for pipelined all_reduce
    chan: ``size`` rings of ``ring_bytes``, ring q carries the owner's messages to rank q
    """

    size: int
    slot_bytes: int
    ring_bytes: int
    slots: int = 2

    @property
    def ctrl_lines(self) -> int:
        return 9 + 3 * self.size

    def opened_line(self, q: int) -> int:
        return 8 + 2 * self.size + q

    @property
    def token_offset(self) -> int:
        return (8 + 3 * self.size) * LINE

    @staticmethod
    def head_line(q: int) -> int:
        return 8 + 2 * q

    @staticmethod
    def tail_line(q: int) -> int:
        return 9 + 2 * q

    @property
    def coll_offset(self) -> int:
        return -(-self.ctrl_lines * LINE // 4096) * 4096

    @property
    def chan_offset(self) -> int:
        return self.coll_offset + self.slots * self.slot_bytes

    @property
    def total(self) -> int:
        return self.chan_offset + self.size * self.ring_bytes


class Segment:
    """One mapped segment: int64 control lines (numpy, cheap single-element access) and
    byte views (torch) of the collective slots and channel rings.

    The owner's segment holds its :class:`files.OwnerLock`; a peer's holds the descriptor it was
    opened through (the test of :meth:`owner_alive`). ``wake_fd``: the wake-up FIFO, read-write
    for the owner (it never sees EOF), write-only for a peer (one byte wakes the owner)."""

    def __init__(self, name: str, layout: Layout, mm: mmap.mmap, wake_fd: int, token: bytes,
                 lock: files.OwnerLock | None = None, fd: int | None = None):
        self.name, self.layout, self.mm, self.token = name, layout, mm, token
        self.owner = lock is not None
        self.lock, self.fd, self.wake_fd = lock, fd, wake_fd
        self.path = os.path.join(SHM_DIR, name)  # for messages; files are reached through files.dir_fd()
        self.linked = self.owner  # the owner is responsible for unlinking the file
        self.ctrl = np.frombuffer(self.mm, dtype=np.int64, count=layout.ctrl_lines * _I64_PER_LINE)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)

    def line(self, i: int) -> int:
        return int(self.ctrl[i * _I64_PER_LINE])

    def set_line(self, i: int, value: int) -> None:
        self.ctrl[i * _I64_PER_LINE] = value

    def slot(self, k: int) -> torch.Tensor:
        lay = self.layout
        start = lay.coll_offset + k * lay.slot_bytes
        return self.bytes[start:start + lay.slot_bytes]

    def ring(self, q: int) -> torch.Tensor:
        lay = self.layout
        start = lay.chan_offset + q * lay.ring_bytes
        return self.bytes[start:start + lay.ring_bytes]

    def owner_alive(self) -> bool:
        """For a peer's segment: False once its owner no longer holds its lock (it died, or closed
        the segment), whatever PID namespace it ran in. A lock held by a third process that tests
        at the same moment reads as alive (the next test decides)."""
        if self.owner or self.fd is None:
            return True
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        return False

    def wake(self) -> None:
        """Wake the owner if it blocks on its pipe (a full pipe already wakes it)."""
        try:
            os.write(self.wake_fd, b"\0")
        except (BlockingIOError, BrokenPipeError, OSError):
            pass

    def drain(self) -> None:
        try:
            while os.read(self.wake_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            for n in (self.name, self.name + ".wake"):
                files.unlink_file(n)

    def close(self) -> None:
        self.unlink()
        # numpy/torch views keep the buffer exported; drop them before closing the map
        self.ctrl = self.bytes = None
        if self.wake_fd is not None:
            os.close(self.wake_fd)
            self.wake_fd = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lock is not None:
            self.lock.release()  # peers' owner_alive says False from now on
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC closes the map later
            pass


def create(name: str, layout: Layout) -> Segment:
    """Create, lock and map a new segment with a fresh token, then its wake-up FIFO (after the
    segment: a sweeper removes a FIFO only when its segment is gone). A full /dev/shm raises a
    CommError saying how much was needed."""
    lock, mm = files.create_file(name, layout.total)
    try:
        token = secrets.token_bytes(TOKEN_BYTES)
        mm[layout.token_offset:layout.token_offset + TOKEN_BYTES] = token
        wake_fd = files.make_fifo(name + ".wake")
    except BaseException:
        mm.close()
        lock.release()
        files.unlink_file(name)
        raise
    seg = Segment(name, layout, mm, wake_fd, token, lock=lock)
    seg.set_line(PID, os.getpid())
    return seg


def open_peer(name: str, layout: Layout, token: bytes, where: str, who: str) -> Segment:
    """Map a peer's segment after every check of files.map_peer_file (``layout``: this rank's own,
    so the size is never the record's alone; ``token``: the one its record carries), and open its
    wake-up FIFO (checked likewise). Nothing is written into it here.

    Raises SegmentRefusedError (a check failed) or PeerLostError (the file is gone).
    """
    fd, mm = files.map_peer_file(name, layout.total, token, layout.token_offset, where, who)
    try:
        wake_fd = files.open_peer_fifo(name + ".wake", where, who)
    except BaseException:
        mm.close()
        os.close(fd)
        raise
    return Segment(name, layout, mm, wake_fd, token, fd=fd)


@dataclass(frozen=True)
class Record:
    """A segment's record in the store, parsed (see :func:`parse_record`)."""

    name: str
    size: int
    host: str
    pid: int
    token: bytes


def record(seg: Segment, host: str) -> str:
    """The store record of this rank's segment: ``<name> <size> <host> <pid> <token hex>``."""
    return f"{seg.name} {seg.layout.total} {host} {os.getpid()} {seg.token.hex()}"


MAX_RECORD = 1024
_HOST = re.compile(r"[^\s]{1,512}")
_SIZE = re.compile(r"[1-9][0-9]{0,15}")
_PID = re.compile(r"[1-9][0-9]{0,9}")
_TOKEN = re.compile(rf"[0-9a-f]{{{2 * TOKEN_BYTES}}}")


def parse_record(raw: bytes, group_name: str, rank: int, where: str, who: str) -> Record:
    """Parse group rank ``rank``'s record strictly: five fields; the name fits that rank's pattern
    in this group (files.name_pattern) and carries the record's pid; size, pid and token in range.

    Raises SegmentRefusedError naming ``who`` and what is wrong.
    """
    def refuse(why: str) -> SegmentRefusedError:
        shown = raw[:120].decode("utf-8", "replace")
        return SegmentRefusedError(f"{where}: refused {who}'s shared-memory record in the store ({why}): {shown!r}; "
                                   f"another user or job may be tampering with the store")

    if len(raw) > MAX_RECORD:
        raise refuse(f"{len(raw)} bytes, at most {MAX_RECORD}")
    try:
        fields = raw.decode("utf-8").split(" ")
    except UnicodeDecodeError:
        raise refuse("not UTF-8") from None
    if len(fields) != 5:
        raise refuse(f"{len(fields)} fields, 5 expected: name size host pid token")
    name, size, host, pid, token = fields
    m = files.name_pattern(group_name, rank).fullmatch(name)
    if m is None:
        raise refuse(f"the name is not a segment name of rank {rank} of this group")
    if not _SIZE.fullmatch(size):
        raise refuse("the size is not a positive integer")
    if not _HOST.fullmatch(host):
        raise refuse("the host is empty or too long")
    if not _PID.fullmatch(pid) or int(pid) >= 1 << 31 or m.group("pid") != pid:
        raise refuse("the pid is out of range or differs from the name's")
    if not _TOKEN.fullmatch(token):
        raise refuse(f"the token is not {TOKEN_BYTES} bytes of hex")
    return Record(name, int(size), host, int(pid), bytes.fromhex(token))
