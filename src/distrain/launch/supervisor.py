"""The one local supervisor: it starts rank processes, watches them and ends them, for every job.

``spawn`` (a fixed job), the elastic coordinator and each elastic node agent are layers on this
class; none of them starts, polls or kills a process any other way. Contract:

* ``start(ident, fn, args, env=..., threads=..., cores=..., setup=...)`` starts one process
  (multiprocessing, forkserver by default) that sets ``env``, binds ``cores``, dies with the top
  process (distrain.lifeline), ends silently on Ctrl-C, runs ``setup(ident, report)`` and then
  ``fn(ident, *args)``, and sends back exactly one outcome over a pipe;
* ``poll(timeout)`` returns the :class:`Outcome` of every process that ended (or reported a hang)
  since the last call, waiting at most ``timeout`` seconds for the first one: ``"ok"`` with fn's
  value, ``"err"`` with our error's one line or the traceback, ``"died"`` (no word: a signal,
  ``os._exit``; it is seen at once through the process's sentinel) or ``"hang"`` (the collective
  watchdog's report, sent through ``report`` before it ends the rank);
* ``kill(ident)`` (SIGKILL, at once) and ``end()`` (SIGTERM, then SIGKILL after ``grace``) end
  processes; ``close()`` ends every one still running and releases the pipes.

An identity is an int the caller chooses (a rank, or an elastic id that never repeats).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch

from distrain import lifeline, runtime
from distrain.blame import is_secondary
from distrain.errors import DistrainError
from distrain.launch.title import set_title

__all__ = ["Outcome", "Supervisor", "send_outcome"]


@dataclass
class Outcome:
    """How one process ended (or, ``status == "hang"``, that it reported a hung collective)."""

    ident: int
    status: str  # "ok" | "err" | "died" | "hang"
    value: Any  # fn's return value, the error text, or how the process ended
    when: float  # time.time(): rank side for reported outcomes, the supervisor's for deaths
    secondary: bool = False  # the error is the transport seeing a lost peer (blame.is_secondary)
    exitcode: int | None = None


def send_outcome(conn, work: Callable[[], Any]) -> None:
    """Run ``work()`` in a rank and send its outcome over ``conn``: ("ok", value, time, False), or
    ("err", message, time, secondary) where our errors (which say what to fix) send their one line and
    any other exception its traceback; then leave the process group."""
    try:
        payload = pickle.dumps(("ok", work(), time.time(), False))
    except DistrainError as e:
        payload = pickle.dumps(("err", f"{type(e).__name__}: {e}", time.time(), is_secondary(e)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        payload = pickle.dumps(("err", traceback.format_exc(), time.time(), is_secondary(e)))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
    runtime.shutdown()


def _child(fn, ident: int, args: tuple, env: dict[str, str], threads: int, cores, conn, setup,
           title: str | None = None) -> None:
    """A rank process's life: its title (``ps``), environment, core binding (before torch starts its thread
    pools, so every thread inherits it), lifeline, then ``setup`` and ``fn``; its outcome goes to the
    supervisor."""
    if title:
        set_title(title)
    os.environ.update(env)
    if cores:
        os.sched_setaffinity(0, cores)
    lifeline.die_with_parent()  # reads DISTRAIN_PARENT_PID from env
    lifeline.quiet_interrupts()
    torch.set_num_threads(threads)

    def report(status: str, value) -> None:  # e.g. from the watchdog thread, just before it ends this rank
        conn.send_bytes(pickle.dumps((status, value, time.time(), False)))

    def work():
        if setup is not None:
            setup(ident, report)
        return fn(ident, *args)

    send_outcome(conn, work)


class Supervisor:
    """Local rank processes by identity (see the module docstring)."""

    def __init__(self, start_method: str = "forkserver", preload: Sequence[str] = (), name: str = "distrain-rank"):
        self.ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # (launch.warm: what every rank's first optimizer would import, ~1 s, once in the fork server)
            # (distrain.launch imports its modules on use: local and torchrun named, as the package's import did)
            self.ctx.set_forkserver_preload(["distrain.comm", "distrain.launch.local", "distrain.launch.torchrun",
                                             "distrain.launch.warm", *preload])
        self.name = name
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Any] = {}
        self.started: dict[int, float] = {}  # ident -> time.time() of its start
        self.ended: dict[int, Outcome] = {}

    # -- starting and ending ----------------------------------------------------------------------
    def start(self, ident: int, fn: Callable[..., Any], args: Sequence = (), env: dict[str, str] | None = None,
              threads: int = 1, cores: list[int] | None = None, setup: Callable | None = None,
              title: str | None = None) -> None:
        """Start process ``ident`` running ``setup(ident, report)`` then ``fn(ident, *args)``; ``title``: its
        name in ``ps`` (launch/title.py)."""
        recv, send = self.ctx.Pipe(duplex=False)
        p = self.ctx.Process(target=_child, name=f"{self.name}{ident}",
                             args=(fn, ident, tuple(args), dict(env or {}), threads, cores, send, setup, title))
        p.start()
        send.close()
        self.procs[ident], self.conns[ident], self.started[ident] = p, recv, time.time()

    def kill(self, ident: int) -> None:
        """SIGKILL process ``ident`` now (no-op when it has ended)."""
        p = self.procs.get(ident)
        if p is not None and p.is_alive():
            p.kill()
            p.join(5)

    def end(self, idents: Iterable[int] | None = None, grace: float = 3.0) -> None:
        """SIGTERM the running processes (all, or ``idents``), SIGKILL those still alive after ``grace`` s."""
        procs = [self.procs[i] for i in (self.procs if idents is None else idents) if i in self.procs]
        for p in procs:
            if p.is_alive():
                p.terminate()
        deadline = time.monotonic() + grace
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)

    def join(self, timeout: float, idents: Iterable[int] | None = None) -> None:
        """Wait up to ``timeout`` s in all for the processes (all, or ``idents``) to exit by themselves
        (after their result)."""
        deadline = time.monotonic() + timeout
        for i in self.procs if idents is None else idents:
            self.procs[i].join(max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """End every process still running and release the pipes."""
        self.end()
        for c in self.conns.values():
            c.close()

    # -- watching ---------------------------------------------------------------------------------
    def running(self) -> list[int]:
        """The identities whose outcome has not been seen yet."""
        return [i for i in self.procs if i not in self.ended]

    def exitcode(self, ident: int) -> int | None:
        return self.procs[ident].exitcode

    def poll(self, timeout: float | None) -> list[Outcome]:
        """The outcomes that arrived, waiting up to ``timeout`` s (None: until one does) for the first."""
        live = self.running()
        if not live:
            return []
        waitables = {self.conns[i]: i for i in live} | {self.procs[i].sentinel: i for i in live}
        out = []
        for w in mp.connection.wait(list(waitables), timeout=timeout):
            i = waitables[w]
            if i in self.ended or any(o.ident == i and o.status != "hang" for o in out):
                continue
            o = self._receive(i, sentinel=w is self.procs[i].sentinel)
            if o.status != "hang":
                self.ended[i] = o
            out.append(o)
        return out

    def _receive(self, i: int, sentinel: bool) -> Outcome:
        conn, proc = self.conns[i], self.procs[i]
        if sentinel and not conn.poll():
            return self._died(i)
        try:
            status, value, when, secondary = pickle.loads(conn.recv_bytes())
        except EOFError:
            return self._died(i)
        return Outcome(i, status, value, when, secondary, proc.exitcode)

    def _died(self, i: int) -> Outcome:
        proc = self.procs[i]
        proc.join(1)
        return Outcome(i, "died", died_message(proc.exitcode), time.time(), exitcode=proc.exitcode)


def died_message(code: int | None) -> str:
    """How a process that sent no outcome ended, with what to look at."""
    msg = f"process exited with code {code} before returning"
    if code is not None and code < 0:
        msg += f" (killed by {signal_cause(-code)})"
    return msg


# what usually sends a signal that ends a rank without a word
SENDERS = {"SIGKILL": "the kernel's OOM killer when the host runs out of memory (`dmesg` says so), or `kill -9`",
           "SIGTERM": "an operator (`kill`) or a job scheduler ending the job",
           "SIGINT": "an operator (Ctrl-C)", "SIGHUP": "a closed terminal or session"}


def signal_cause(signum: int) -> str:
    """``SIGKILL, usually the kernel's OOM killer ...``: the signal and what usually sends it."""
    try:
        name = signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    if name in SENDERS:
        return f"{name}, usually {SENDERS[name]}"
    if name == "SIGABRT":  # (the backend aborts the process on a fatal error of its own)
        return (f"{name}; if the backend aborted, its message is on stderr above: a collective mismatch across "
                f"ranks is the usual cause, rerun with DISTRAIN_DEBUG=1 to find it")
    return f"{name} (signal {signum})"
