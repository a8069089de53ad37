"""Ranks die with the process that started them; the top process stops cleanly on signals.

Contract:

* :func:`die_with_parent` (called in every rank, first thing) ends the rank when the top
  process of the job (``distrain train``, ``distrain launch``, or any caller of
  ``distrain.spawn``) is gone, whatever killed it, SIGKILL included. Two mechanisms, because
  either alone has a gap:

  - ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux, see prctl(2)): the kernel kills the rank
    when its *direct* parent exits. Under ``spawn`` the direct parent is multiprocessing's
    fork server, which itself exits when the top process does; under torchrun it is the
    launcher itself.
  - a daemon *lifeline* thread that watches the top process (pid from the environment
    variable ``DISTRAIN_PARENT_PID``) through a pidfd (pidfd_open(2); readable once the
    process has exited), or by polling where pidfds are missing, and ends the rank with
    ``os._exit`` as soon as it is gone.

* :func:`stop_on_signals` (called by the top process) turns SIGTERM and SIGHUP (what
  ``docker stop``, ``kill PID`` and a closed terminal send) into a :class:`Stopped`
  exception in the main thread, so the ``finally`` blocks that end the ranks run.
* :func:`quiet_interrupts` (ranks): Ctrl-C reaches the whole foreground process group; a
  rank then ends at once without a traceback (the kernel's default action for SIGINT) and
  only the top process reports, so the user sees one line instead of one traceback per rank.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time

PARENT_ENV = "DISTRAIN_PARENT_PID"
_PR_SET_PDEATHSIG = 1
_EXIT_ORPHANED = 125  # exit status of a rank whose top process vanished
_watching: set[int] = set()


class Stopped(BaseException):
    """The top process received SIGTERM or SIGHUP (a BaseException, like KeyboardInterrupt,
    so ``except Exception`` blocks do not swallow it)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _set_pdeathsig(sig: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _watch(pid: int) -> None:
    """Block until process ``pid`` has exited, then end this process."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while not poller.poll(60_000):
            pass
    else:
        while _alive(pid):
            time.sleep(0.5)
    os._exit(_EXIT_ORPHANED)


def die_with_parent(top_pid: int | None = None) -> None:
    """End this process when its parent or the top process ``top_pid`` exits (idempotent).

    ``top_pid`` defaults to ``$DISTRAIN_PARENT_PID``; without either only the direct parent
    is watched (through PR_SET_PDEATHSIG).
    """
    parent = os.getppid()
    _set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(_EXIT_ORPHANED)
    if top_pid is None and os.environ.get(PARENT_ENV, "").isdigit():
        top_pid = int(os.environ[PARENT_ENV])
    if top_pid is None or top_pid == os.getpid() or top_pid in _watching:
        return
    if not _alive(top_pid):
        os._exit(_EXIT_ORPHANED)
    _watching.add(top_pid)
    threading.Thread(target=_watch, args=(top_pid,), name=f"distrain-lifeline-{top_pid}", daemon=True).start()


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


def stop_on_signals() -> dict:
    """In the top process: SIGTERM and SIGHUP raise :class:`Stopped` in the main thread.
    Returns the previous handlers (for :func:`restore`)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _raise_stopped) for sig in (signal.SIGTERM, signal.SIGHUP)}


def restore(handlers: dict) -> None:
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def quiet_interrupts() -> None:
    """In a rank: Ctrl-C (SIGINT to the process group) ends it silently; the top process reports."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_DFL)
