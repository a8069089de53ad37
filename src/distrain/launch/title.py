"""A rank process's title, as ``ps`` and ``top`` show it: ``distrain rank 2/4``.

Every rank of a local job is a child of the multiprocessing fork server, so without a title each one
reads ``python -c from multiprocessing.forkserver import main ...`` in ``ps``. :func:`set_title` names
the process through the kernel's ``prctl(PR_SET_NAME)`` (``/proc/PID/comm``: what ``ps -e``,
``top`` and ``pgrep`` show; the kernel keeps 15 bytes, so ``distrain rank 12/16`` reads
``distrain rank 1``) and, through ``setproctitle`` (a dependency of distrain; an install without it
keeps the kernel's name only), the command line (``/proc/PID/cmdline``: what ``ps aux`` and ``ps -f``
show, in full).
"""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["COMM_BYTES", "rank_title", "set_title"]

PR_SET_NAME = 15  # <linux/prctl.h>
COMM_BYTES = 15  # the kernel's TASK_COMM_LEN (16) less the terminating NUL


def rank_title(rank: int, world: int) -> str:
    """``distrain rank 2/4``: rank ``rank`` of a group of ``world``."""
    return f"distrain rank {rank}/{world}"


def set_title(title: str) -> None:
    """Name this process ``title`` (see the module docstring); a platform without prctl keeps its name."""
    try:
        import setproctitle  # the full command line

        setproctitle.setproctitle(title)
    except ImportError:
        pass
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.prctl(PR_SET_NAME, ctypes.c_char_p(title.encode()[:COMM_BYTES]), 0, 0, 0)
    except (OSError, AttributeError):  # (no libc prctl: not Linux)
        pass
