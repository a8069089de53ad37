"""The transport's files in /dev/shm: names, creation, opening a peer's file, owner locks, cleanup.

/dev/shm is shared by every local user (mode 1777), and a peer's file is found by a name read
from the store, so nothing about a file is taken on trust:

* names follow one pattern, ``distrain-<pid>-<8 hex>-g<group tag>-r<rank>`` (a segment),
  ``<segment>-s<k>`` (a symmetric allocation), ``<segment>.wake`` (its wake-up FIFO): no
  separators, no dots but the one of ``.wake``, only the characters listed; a name is used only
  relative to a descriptor of /dev/shm (``dir_fd``), never joined into a path;
* every open is ``O_NOFOLLOW | O_CLOEXEC`` (a symbolic link is refused, not followed), files are
  created ``O_CREAT | O_EXCL`` with mode 0600 (and chmod'ed to 0600 whatever the umask);
* a peer's file is checked with fstat on the open descriptor before it is mapped: a regular file
  (a FIFO for ``.wake``), owned by this uid, no group or other permission bits, one link, and
  exactly the size this rank's own layout implies; then the random token its owner wrote into it
  must equal the one the owner published in the store (:func:`map_peer_file`). Anything else
  raises :class:`SegmentRefusedError` (one line: this rank, the peer, the file, what is wrong) and
  the file is left untouched (nothing is written into a mapping before every check passed).

Liveness. The creator of a file holds a shared ``flock`` on it from before the file has any size
until it closes it (:class:`OwnerLock`, on a descriptor of its own that forked children drop).
Whoever takes the lock exclusively (non-blocking) knows the creator is gone: the kernel drops a
dead process's locks, whatever its PID namespace. Two users of that test: :func:`sweep_stale`,
which unlinks only our own (uid) pattern-named files whose lock it gets, and the dead-peer check
of the waits (segment.Segment.owner_alive and the extension's owner_alive).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import hashlib
import mmap
import multiprocessing.util
import os
import re
import secrets
import stat
import threading
import time

from distrain.errors import CommError, PeerLostError

SHM_DIR = "/dev/shm"
PREFIX = "distrain-"
TOKEN_BYTES = 16
# an empty file whose lock is free may be one whose creator is between creating and locking it
CREATE_GRACE_S = 30.0

_TAG = r"[A-Za-z0-9_]{1,64}"
_BASE = rf"distrain-(?P<pid>[1-9][0-9]{{0,9}})-[0-9a-f]{{8}}-g{_TAG}-r(?:0|[1-9][0-9]{{0,8}})"
_FILE_RE = re.compile(rf"{_BASE}(?:-s(?:0|[1-9][0-9]{{0,8}}))?")  # a segment or a symmetric allocation
_WAKE_RE = re.compile(rf"(?P<base>{_BASE})\.wake")


class SegmentRefusedError(CommError):
    """A peer's store record or /dev/shm file failed a check (pattern, owner, mode, size, token):
    a forged record or a planted file, or ranks of different jobs mixed up. Not a PeerLostError:
    the peer is not known to be gone, and re-forming the group would read the same record."""


def group_tag(group_name: str) -> str:
    """The group's part of a file name: its name if it fits the pattern, else a hash of it (the
    same on every rank of the group)."""
    if re.fullmatch(_TAG, group_name):
        return group_name
    return "h" + hashlib.sha256(group_name.encode()).hexdigest()[:16]


def new_name(group_name: str, rank: int) -> str:
    """A fresh segment name for this process, group and rank (never reused: 32 random bits)."""
    return f"{PREFIX}{os.getpid()}-{secrets.token_hex(4)}-g{group_tag(group_name)}-r{rank}"


def name_pattern(group_name: str, rank: int) -> re.Pattern:
    """What the segment name of group rank ``rank`` must look like (its pid captured)."""
    return re.compile(rf"distrain-(?P<pid>[1-9][0-9]{{0,9}})-[0-9a-f]{{8}}-g{re.escape(group_tag(group_name))}"
                      rf"-r{rank}")


def is_file_name(name: str) -> bool:
    """Whether ``name`` is a segment or symmetric-allocation name of this transport."""
    return _FILE_RE.fullmatch(name) is not None


_dir_fds: dict[str, int] = {}
_dir_lock = threading.Lock()


def dir_fd() -> int:
    """A descriptor of SHM_DIR (opened once per process) that every name is resolved against."""
    with _dir_lock:
        fd = _dir_fds.get(SHM_DIR)
        if fd is None:
            fd = _dir_fds[SHM_DIR] = os.open(SHM_DIR, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return fd


class OwnerLock:
    """The shared flock a file's creator holds while the file is in use (see the module doc), on
    a descriptor no mapping shares: closing it releases the lock even while a mapping lives on, and
    a forked child closes its copy at once (:func:`_drop_in_child`), so a child that outlives its
    parent does not keep the parent looking alive."""

    def __init__(self, fd: int):
        self.fd: int | None = fd
        fcntl.flock(fd, fcntl.LOCK_SH)
        with _held_lock:
            _held.add(self)

    def release(self) -> None:
        with _held_lock:
            _held.discard(self)
            fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)


_held: set[OwnerLock] = set()
_held_lock = threading.Lock()


def _drop_in_child() -> None:
    for lock in list(_held):
        if lock.fd is not None:
            os.close(lock.fd)  # the child's reference only: the parent keeps its lock
            lock.fd = None
    _held.clear()


os.register_at_fork(after_in_child=_drop_in_child)


def create_file(name: str, size: int) -> tuple[OwnerLock, mmap.mmap]:
    """Create SHM_DIR/<name> (mode 0600, exclusive, no link followed) with ``size`` bytes reserved,
    locked by its :class:`OwnerLock`, and map it. A full /dev/shm raises a CommError saying how much
    was needed, with the file removed. The file is remembered for unlinking at exit."""
    sweep_stale()
    d = dir_fd()
    try:
        fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
    except FileExistsError:
        raise _taken(name) from None
    _remember(name)
    lock = OwnerLock(fd)  # before the file has a size: a sweeper leaves an empty young file alone
    try:
        os.fchmod(fd, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # reserve the pages now: ENOSPC here, not SIGBUS later
        except OSError as e:
            st = os.statvfs(SHM_DIR)
            raise CommError(
                f"shared-memory transport: cannot allocate {size} bytes in {SHM_DIR} ({e.strerror}; "
                f"{st.f_bavail * st.f_frsize} bytes free); free space in {SHM_DIR} or use --transport torch "
                f"(DISTRAIN_TRANSPORT=torch)"
            ) from None
        # map through a second open of the same file, so that the mapping does not hold the lock
        mfd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
        try:
            a, b = os.fstat(fd), os.fstat(mfd)
            if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):
                raise CommError(f"shared-memory transport: {SHM_DIR}/{name} was replaced while it was created")
            mm = mmap.mmap(mfd, size)
        finally:
            os.close(mfd)
    except BaseException:
        lock.release()
        unlink_file(name)
        raise
    return lock, mm


def make_fifo(name: str) -> int:
    """Create the FIFO SHM_DIR/<name> (mode 0600) and open it read-write, non-blocking (its owner's
    end: it never sees EOF). Remembered for unlinking at exit."""
    d = dir_fd()
    try:
        os.mkfifo(name, 0o600, dir_fd=d)  # fails on any existing name, a symbolic link included
    except FileExistsError:
        raise _taken(name) from None
    _remember(name)
    try:
        fd = os.open(name, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=d)
        os.fchmod(fd, 0o600)
    except BaseException:
        unlink_file(name)
        raise
    return fd


def _taken(name: str) -> CommError:
    return CommError(f"shared-memory transport: cannot create {SHM_DIR}/{name}: the name exists already (names are "
                     f"random, so another local user may have created it first); rerun, or use --transport torch")


def _refused(where: str, who: str, what: str, name: str, why: str) -> SegmentRefusedError:
    return SegmentRefusedError(f"{where}: refused {who}'s {what} {SHM_DIR}/{name}: {why}; only files this job's "
                               f"ranks created are mapped (another user or job may be tampering with {SHM_DIR} or "
                               f"the store)")


def _gone(where: str, who: str, name: str) -> PeerLostError:
    what = "wake-up FIFO" if name.endswith(".wake") else "shared-memory segment"
    return PeerLostError(f"{where}: {who}'s {what} {SHM_DIR}/{name} is gone (did that rank exit or were the ranks "
                         f"started on different hosts?); use --transport torch")


def _open_checked(name: str, flags: int, kind: str, size: int | None, where: str, who: str, what: str) -> int:
    """Open a peer's file without following a link, and check it with fstat (see the module doc)."""
    if not (is_file_name(name) or (_WAKE_RE.fullmatch(name) and kind == "fifo")):
        raise _refused(where, who, what, name, "its name does not fit the transport's pattern")
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd())
    except FileNotFoundError:
        raise _gone(where, who, name) from None
    except OSError as e:
        if e.errno == errno.ENXIO and kind == "fifo":  # a FIFO nobody reads: its owner has closed it
            raise _gone(where, who, name) from None
        why = "it is a symbolic link" if e.errno == errno.ELOOP else f"it cannot be opened ({e.strerror})"
        raise _refused(where, who, what, name, why) from None
    try:
        st = os.fstat(fd)
        is_kind = stat.S_ISFIFO(st.st_mode) if kind == "fifo" else stat.S_ISREG(st.st_mode)
        why = None
        if not is_kind:
            why = f"it is not a {'FIFO' if kind == 'fifo' else 'regular file'}"
        elif st.st_uid != os.geteuid():
            why = f"it is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
        elif st.st_mode & 0o077:
            why = f"its mode {stat.S_IMODE(st.st_mode):04o} lets group or others in (0600 expected)"
        elif st.st_nlink > 1:
            why = f"it has {st.st_nlink} hard links (1 expected)"
        elif size is not None and st.st_size != size:
            why = f"it has {st.st_size} bytes, this group's layout needs {size}"
        if why is not None:
            raise _refused(where, who, what, name, why)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_peer_file(name: str, size: int, token: bytes, token_at: int, where: str, who: str,
                  what: str = "shared-memory segment") -> tuple[int, mmap.mmap]:
    """Open a peer's file SHM_DIR/<name>, check it (pattern, no link, regular, owner, mode, links,
    ``size``), map it, and check that the ``TOKEN_BYTES`` at ``token_at`` equal ``token`` (the one
    its owner published). Returns (the open descriptor, the mapping); nothing is written.

    Raises SegmentRefusedError for a file that fails a check, PeerLostError if it does not exist.
    """
    fd = _open_checked(name, os.O_RDWR, "file", size, where, who, what)
    try:
        mm = mmap.mmap(fd, size)
        if mm[token_at:token_at + TOKEN_BYTES] != token:
            mm.close()
            raise _refused(where, who, what, name, "its token differs from the one its rank published in the store "
                                                   "(a file planted under that name)")
    except BaseException:
        os.close(fd)
        raise
    return fd, mm


def open_peer_fifo(name: str, where: str, who: str) -> int:
    """A peer's wake-up FIFO, opened write-only, non-blocking, and checked (FIFO, owner, mode)."""
    return _open_checked(name, os.O_WRONLY | os.O_NONBLOCK, "fifo", None, where, who, "wake-up FIFO")


def unlink_file(name: str) -> None:
    """Remove SHM_DIR/<name>, a file this process created (or a peer's, once mapped), and forget it."""
    _forget(name)
    try:
        os.unlink(name, dir_fd=dir_fd())
    except FileNotFoundError:
        pass


def sweep_stale() -> list[str]:
    """Unlink the transport's files that no live process holds: our uid's pattern-named regular
    files whose lock this call gets (their creator is dead, in whatever PID namespace), and our
    FIFOs whose segment is gone. Returns the names removed."""
    removed = []
    try:
        d = dir_fd()
        names = os.listdir(d)
    except OSError:
        return removed
    uid = os.geteuid()
    for n in names:
        if is_file_name(n) and _sweep_file(d, n, uid):
            removed.append(n)
    present = set(os.listdir(d)) if removed else set(names)
    for n in names:
        m = _WAKE_RE.fullmatch(n)
        if m and m.group("base") not in present and _sweep_fifo(d, n, uid):
            removed.append(n)
    return removed


def _sweep_file(d: int, n: str, uid: int) -> bool:
    try:
        st = os.stat(n, dir_fd=d, follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            return False
        fd = os.open(n, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=d)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its creator holds it: alive
        st = os.fstat(fd)
        if st.st_size == 0 and time.time() - st.st_ctime < CREATE_GRACE_S:
            return False  # its creator may be between creating and locking it
        now = os.stat(n, dir_fd=d, follow_symlinks=False)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or st.st_uid != uid:
            return False
        os.unlink(n, dir_fd=d)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _sweep_fifo(d: int, n: str, uid: int) -> bool:
    try:
        st = os.stat(n, dir_fd=d, follow_symlinks=False)
        if not stat.S_ISFIFO(st.st_mode) or st.st_uid != uid:
            return False
        os.unlink(n, dir_fd=d)
        return True
    except OSError:
        return False


# Files this process created and has not unlinked yet: removed at exit whatever happens.
_linked: set[str] = set()
_linked_lock = threading.Lock()


def _remember(name: str) -> None:
    _register_finalizer()
    with _linked_lock:
        _linked.add(name)


def _forget(name: str) -> None:
    with _linked_lock:
        _linked.discard(name)


def _cleanup_at_exit() -> None:
    with _linked_lock:
        names = list(_linked)
        _linked.clear()
    for n in names:
        try:
            os.unlink(n, dir_fd=dir_fd())
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
