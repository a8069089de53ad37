"""Shared-memory segments in /dev/shm: creation, lookup through the store, and cleanup.

Each rank of a shared-memory group creates ONE segment (a file in /dev/shm, mapped with
mmap) and publishes its name and size in the process group's store; peers open it by
that name when they first need it. Names are unique per run and carry the creator's pid:

    /dev/shm/distrain-<pid>-<random 8 hex>-g<group>-r<rank>

Cleanup, so that no run leaves files behind and no run trips over an older one's:

* a new run never reuses a name (the random part), so stale files cannot confuse it;
* a file is unlinked as soon as every peer has mapped it (the mapping outlives the name;
  each peer sets its own "opened" line in the segment), so once every pair has talked
  nothing is left on disk even if ranks are later killed with SIGKILL: the kernel frees
  the memory when the last mapping goes;
* until then, the creator unlinks it on group destroy and at process exit (atexit), and a
  survivor unlinks the files of peers whose process is dead when it exits;
* creating a segment first sweeps /dev/shm for distrain files whose creator process no
  longer exists on this host (left by a run killed during setup).

Layout of a segment (offsets in bytes, every region 64-byte aligned, one writer per line)
is described in :class:`Layout`. Beside each segment a FIFO (``<name>.wake``) lets a rank
that has waited too long to keep polling block in the kernel until a peer writes a byte
(a peer does so after publishing a flag, if the rank's "sleeping" line is set).
"""

from __future__ import annotations

import atexit
import mmap
import multiprocessing.util
import os
import re
import secrets
import threading
from dataclasses import dataclass

import numpy as np
import torch

from distrain.errors import CommError

SHM_DIR = "/dev/shm"
PREFIX = "distrain-"
LINE = 64  # bytes per cache line: every flag sits alone on its line (no false sharing)
_I64_PER_LINE = LINE // 8
# ctrl lines of a segment (see Layout): which line each flag lives on
ARRIVE, DONE, ABORT, PID, RESULT, SLEEPING, CONSUMED, SYMMETRIC = 0, 1, 2, 3, 4, 5, 6, 7
_NAME_RE = re.compile(r"^distrain-(\d+)-[0-9a-f]{8}-")


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
        return 8 + 3 * self.size

    def opened_line(self, q: int) -> int:
        return 8 + 2 * self.size + q

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
    byte views (torch) of the collective slots and channel rings."""

    def __init__(self, name: str, layout: Layout, fd: int, owner: bool):
        self.name, self.layout, self.owner = name, layout, owner
        self.path = os.path.join(SHM_DIR, name)
        self.mm = mmap.mmap(fd, layout.total)
        self.linked = owner  # the owner is responsible for unlinking the file
        self.ctrl = np.frombuffer(self.mm, dtype=np.int64, count=layout.ctrl_lines * _I64_PER_LINE)
        self.bytes = torch.frombuffer(self.mm, dtype=torch.uint8)
        # the wake-up pipe: the owner reads it (opened read-write, so it never sees EOF),
        # peers write one byte to wake it
        flags = (os.O_RDWR if owner else os.O_WRONLY) | os.O_NONBLOCK
        self.wake_fd = os.open(self.path + ".wake", flags)

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
            for p in (self.path, self.path + ".wake"):
                unlink_file(p)

    def close(self) -> None:
        self.unlink()
        # numpy/torch views keep the buffer exported; drop them before closing the map
        self.ctrl = self.bytes = None
        if self.wake_fd is not None:
            os.close(self.wake_fd)
            self.wake_fd = None
        try:
            self.mm.close()
        except BufferError:  # a view is still alive somewhere: the GC closes the map later
            pass


def new_name(group_tag: str, rank: int) -> str:
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-g{group_tag}-r{rank}"


def create(name: str, layout: Layout) -> Segment:
    """Create and map a new segment; a full /dev/shm raises a CommError saying how much was needed."""
    path = os.path.join(SHM_DIR, name)
    os.mkfifo(path + ".wake", 0o600)
    _remember(path + ".wake")
    fd = allocate_file(name, layout.total, extra=(path + ".wake",))
    try:
        seg = Segment(name, layout, fd, owner=True)
    finally:
        os.close(fd)
    seg.set_line(3, os.getpid())
    return seg


def allocate_file(name: str, size: int, extra: tuple[str, ...] = ()) -> int:
    """Create /dev/shm/<name> with ``size`` bytes reserved and return its open descriptor
    (remembered for unlinking at exit). A full /dev/shm raises a CommError saying how much was
    needed; then the file and the ``extra`` paths are removed."""
    sweep_stale()
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _remember(path)
    try:
        os.posix_fallocate(fd, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS later
    except OSError as e:
        os.close(fd)
        for p in (path, *extra):
            _forget(p)
            os.unlink(p)
        st = os.statvfs(SHM_DIR)
        raise CommError(
            f"shared-memory transport: cannot allocate {size} bytes in {SHM_DIR} ({e.strerror}; "
            f"{st.f_bavail * st.f_frsize} bytes free); free space in {SHM_DIR} or use --transport torch "
            f"(DISTRAIN_TRANSPORT=torch)"
        ) from None
    return fd


def unlink_file(path: str) -> None:
    """Remove a file this process created (or a peer's, once mapped) and forget it."""
    _forget(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def open_existing(name: str, layout: Layout, who: str) -> Segment:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise CommError(f"shared-memory transport: {who}'s segment {path} is gone (did that rank exit or "
                        f"were the ranks started on different hosts?); use --transport torch") from None
    try:
        return Segment(name, layout, fd, owner=False)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """True if process ``pid`` exists on this host and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    except OSError:
        return True


def sweep_stale() -> list[str]:
    """Unlink distrain segments whose creator process is dead (a crashed run's leftovers)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for n in names:
        m = _NAME_RE.match(n)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, n))
                removed.append(n)
            except OSError:
                pass
    return removed


# Files this process created and has not unlinked yet: removed at exit whatever happens.
_linked: set[str] = set()
_linked_lock = threading.Lock()


def _remember(path: str) -> None:
    _register_finalizer()
    with _linked_lock:
        _linked.add(path)


def _forget(path: str) -> None:
    with _linked_lock:
        _linked.discard(path)


def _cleanup_at_exit() -> None:
    with _linked_lock:
        paths = list(_linked)
        _linked.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass
    sweep_stale()


atexit.register(_cleanup_at_exit)
_finalizer_pid = 0


def _register_finalizer() -> None:
    """Processes started by multiprocessing (distrain.spawn) leave through os._exit, which
    skips atexit; multiprocessing runs its own exit finalizers (cleared in each new child,
    hence registered on first use in this process)."""
    global _finalizer_pid
    if _finalizer_pid != os.getpid():
        _finalizer_pid = os.getpid()
        multiprocessing.util.Finalize(None, _cleanup_at_exit, exitpriority=0)
