"""One run per output folder: an exclusive lock on ``<out>/.distrain.lock``.

Contract: :func:`hold` creates ``out`` (a clear ConfigError if it cannot be created or
written), then takes an exclusive, non-blocking ``flock(2)`` on the lock file and writes
who holds it (pid, host, start time, command). A second run into the same folder is refused
with a one-line error naming the holder. The kernel drops the lock when the holder's file
descriptor closes, so a holder that dies, even by SIGKILL, never leaves a stale lock (unlike
a pid file, nothing has to decide whether the old pid is still alive). The lock file stays
behind unless the holder asks for it to go (``release=True``, what ``distrain train`` does): it is
then unlinked while still locked, and every holder, after taking the lock, checks that the path
still names the inode it locked (else it opens the path again), so a run that opened the old file
before the unlink never holds a lock beside a run that locked the new one.

A run that fails can take its folder with it (``discard``): when this call created ``out`` (and any
missing parents) and the block raises, ``discard()`` decides whether anything there is worth keeping;
if not, ``out`` is removed whole and the parents this call made are removed while empty.

Whose folder (:func:`check_owner`, before anything is written into it): ``out`` must belong
to this process's user (its effective uid) and be writable by no one else: not by others
(``o+w``, sticky bit or not: others could still create the names a run writes next, such as
``checkpoint.json``), and not by its group unless that group is the user's private group
(named as the user, the user's primary group, no other member listed: what ``umask 002``
systems give every folder). Otherwise another user could plant or swap the files a run
reads back (its checkpoint, its lock) while it runs.

The lock file is opened with ``O_NOFOLLOW``: a symlink planted as ``.distrain.lock`` is refused
(its target is never opened, let alone truncated), and so is anything but a regular file of
this user with one link (a FIFO, a hard link to another file).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import grp
import json
import os
import pwd
import shutil
import socket
import stat
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

from distrain.errors import ConfigError

LOCK_NAME = ".distrain.lock"


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _private_group(gid: int, uid: int) -> bool:
    """``gid`` is the user-private group of ``uid``: named as the user, its primary group, no other member."""
    try:
        user, group = pwd.getpwuid(uid), grp.getgrgid(gid)
    except KeyError:
        return False
    return group.gr_name == user.pw_name and user.pw_gid == gid and set(group.gr_mem) <= {user.pw_name}


def check_owner(out: Path) -> None:
    """``out`` (an existing folder) belongs to this user and no one else can write it (module docstring);
    else a one-line ConfigError naming the folder, the owner or mode, and the fix."""
    st = os.stat(out)
    me = os.geteuid()
    if st.st_uid != me:
        raise ConfigError(f"--out {out} belongs to {_user(st.st_uid)}, not to this user {_user(me)}; a run writes "
                          f"only into its own user's folders: choose another --out (or run as its owner)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_IWOTH:
        raise ConfigError(f"--out {out} is writable by every user (mode {mode:o}), so another user could plant or "
                          f"replace its checkpoint files; `chmod o-w {out}`, or choose another --out")
    if mode & stat.S_IWGRP and not _private_group(st.st_gid, me):
        try:
            group = grp.getgrgid(st.st_gid).gr_name
        except KeyError:
            group = f"gid {st.st_gid}"
        raise ConfigError(f"--out {out} is writable by the group {group} (mode {mode:o}), so another user could plant "
                          f"or replace its checkpoint files; `chmod g-w {out}`, or choose another --out")


def _prepare(out: Path) -> list[Path]:
    """Make ``out`` ready for a run; returns the folders this call created, ``out`` first, then its parents."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder; choose another --out")
    if out.is_dir():
        check_owner(out)  # before anything is written into it
    missing = [p for p in (out, *out.parents) if not p.exists()]
    made = []
    try:
        for p in reversed(missing):  # (outermost first; a folder another process makes meanwhile is not ours)
            try:
                p.mkdir()
                made.insert(0, p)
            except FileExistsError:
                pass
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the run folder ({e.strerror}); choose a writable path") from None
    if not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder; choose another --out")
    check_owner(out)  # (made now: ours, unless another user made it in between)
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} is not writable by this user; choose a writable folder or fix its permissions")
    return made


def _open_lock(out: Path, path: Path) -> int:
    """The lock file's descriptor: a regular file of this user with one link, never followed through a symlink."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(f"--out {out}: its lock file {path} is a symlink, which a run never follows; remove it "
                              f"(rm {path}) and run again") from None
        raise ConfigError(f"--out {out}: cannot open its lock file {path} ({e.strerror}); remove it, or choose "
                          f"another --out") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_uid != os.geteuid():
        os.close(fd)
        what = ("not a regular file" if not stat.S_ISREG(st.st_mode) else
                f"a file with {st.st_nlink} hard links" if st.st_nlink != 1 else f"owned by {_user(st.st_uid)}")
        raise ConfigError(f"--out {out}: its lock file {path} is {what}, not one this user's runs made; remove it "
                          f"(rm {path}) and run again")
    return fd


def _holder(fd: int) -> str:
    try:
        h = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _lock(out: Path, path: Path) -> int:
    """The descriptor of the locked lock file, the inode ``path`` names now (one unlinked by a holder that
    released it is let go and the path opened again)."""
    while True:
        fd = _open_lock(out, path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise ConfigError(f"--out {out} is in use by a running job ({who}); wait for it to end, "
                              f"stop it, or choose another --out") from None
        mine = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
        os.close(fd)  # (the holder before us removed it after we opened it: lock the file there now)


def _discard(made: list[Path]) -> None:
    """Remove ``made[0]`` (the run folder) whole, then the parents this call made while they are empty."""
    shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        try:
            parent.rmdir()
        except OSError:  # (something else is in it now)
            break


@contextlib.contextmanager
def hold(out: str | os.PathLike, release: bool = False,
         discard: Callable[[], bool] | None = None) -> Iterator[Path]:
    """Hold the run lock of folder ``out`` for the duration of the ``with`` block. ``release``: remove the
    lock file at the end (success or failure). ``discard``: when this call created ``out`` and the block
    raises, ``discard()`` true removes ``out`` (and the parents this call made, while empty)."""
    out = Path(out)
    made = _prepare(out)
    path = out / LOCK_NAME
    fd = _lock(out, path)
    gone = False
    try:
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield path
    except BaseException:
        if made and made[0] == out and discard is not None and discard():
            _discard(made)  # (while still locked: nobody else writes here)
            gone = True
        raise
    finally:
        if release and not gone:
            path.unlink(missing_ok=True)  # (while still locked; see the module docstring)
        os.close(fd)  # releases the lock
