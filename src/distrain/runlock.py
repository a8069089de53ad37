"""One run per output folder: an exclusive lock on ``<out>/.distrain.lock``.

Contract: :func:`hold` creates ``out`` (a clear ConfigError if it cannot be created or
written), then takes an exclusive, non-blocking ``flock(2)`` on the lock file and writes
who holds it (pid, host, start time, command). A second run into the same folder is refused
with a one-line error naming the holder. The kernel drops the lock when the holder's file
descriptor closes, so a holder that dies, even by SIGKILL, never leaves a stale lock (unlike
a pid file, nothing has to decide whether the old pid is still alive). The lock file itself
stays behind on purpose: deleting it would let two runs lock two different inodes.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Iterator

from distrain.errors import ConfigError

LOCK_NAME = ".distrain.lock"


def _prepare(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} exists and is not a folder; choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the run folder ({e.strerror}); choose a writable path") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} is not writable by this user; choose a writable folder or fix its permissions")


def _holder(path: Path) -> str:
    try:
        h = json.loads(path.read_text() or "{}")
        return f"pid {h['pid']} on {h['host']}, started {h['started']}: {h['command']}"
    except (OSError, ValueError, KeyError):
        return "another process"


@contextlib.contextmanager
def hold(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the run lock of folder ``out`` for the duration of the ``with`` block."""
    out = Path(out)
    _prepare(out)
    path = out / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"--out {out} is in use by a running job ({_holder(path)}); wait for it to end, "
                              f"stop it, or choose another --out") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": " ".join(sys.argv)[:300]}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(me).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
