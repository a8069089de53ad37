"""``spawn``: local ranks started from Python, supervised until each returns or one fails.

The user's code is the parent and forks a function into sub-processes (as
torch.multiprocessing.spawn does). spawn's contract:

* the parent hosts the rendezvous TCPStore on a free port of 127.0.0.1 (bound by the OS,
  so there is no race for the port), sealed with a secret of this job (distrain.sealed: other
  users of the host can connect to the loopback, not read or write the job's keys), starts
  ``nprocs`` processes, each of which sets the launcher environment variables (the secret
  among them), calls :func:`distrain.runtime.init` and then ``fn(rank, *args)``;
* it returns fn's return values in rank order (they must be picklable);
* if a rank raises (or dies), every other rank is ended and the parent raises
  :class:`RankFailedError` carrying that rank's number and traceback;
* if ``timeout`` seconds pass, every rank is ended and :class:`SpawnTimeoutError` names the
  ranks still running (and those that never joined the process group).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch.distributed as dist

from distrain import lifeline, rendezvous, runtime, sealed
from distrain.blame import Failure, blame
from distrain.errors import ConfigError, RankFailedError, SpawnTimeoutError
from distrain.launch.cores import core_slices, free_core_slices
from distrain.launch.supervisor import Supervisor
from distrain.launch.title import rank_title

BLAME_GRACE_S = 2.0  # after the first failure, wait this long for the others to pick the first


class _Rendezvous:
    """A spawned rank's setup (run in the rank before ``fn``): the launcher environment of a local job
    whose parent hosts the store, then (``init``) the process group, with hangs reported to the parent."""

    def __init__(self, nprocs: int, port: int, backend: str, init_timeout: float, init: bool, secret: str):
        self.nprocs, self.port, self.backend, self.init_timeout, self.init = nprocs, port, backend, init_timeout, init
        self.secret = secret

    def __call__(self, rank: int, report) -> None:
        os.environ.update({
            sealed.ENV: self.secret,  # the store's secret (runtime.init seals the store with it)
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port), "RANK": str(rank),
            "WORLD_SIZE": str(self.nprocs), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.nprocs),
            "GROUP_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",  # the parent hosts the store
        })
        if self.init:
            runtime.init(self.backend, timeout=self.init_timeout, on_hang=lambda text: report("hang", text))


def _main_guard_missing() -> str | None:
    """The path of the __main__ script if it has no ``if __name__ == "__main__":`` block."""
    import ast
    import sys

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not os.path.exists(path):
        return None
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None
    for node in tree.body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return None
    return path


def _startup_failure(fn, code: int | None) -> str | None:
    """Why a rank may have died while starting (before it ran ``fn``), with what to do."""
    script = _main_guard_missing()
    if script is not None:
        return (f"process exited with code {code} while starting: {script} has no `if __name__ == \"__main__\":` "
                f"guard, so each new rank re-ran the script's top level (and its spawn call) on import. Put the "
                f"code that calls distrain.spawn under `if __name__ == \"__main__\":` and keep {fn.__name__}() at "
                f"module level")
    return None


def _check_not_bootstrapping() -> None:
    if getattr(mp.process.current_process(), "_inheriting", False):
        raise ConfigError("distrain.spawn was called while a rank was starting: the script that calls it needs an "
                          "`if __name__ == \"__main__\":` guard around the call (each rank imports the script)")


def _early_death(fn, store, nprocs: int, code: int | None, message: str) -> str | None:
    """A rank failed: when it died without a result before any rank joined the process group,
    say why it could not start (None otherwise)."""
    if code == 1 and message.startswith("process exited") and not runtime.joined_ranks(store, nprocs):
        hint = _startup_failure(fn, code)
        if hint is not None:
            return hint
        return (f"process exited with code {code} while starting, before any rank joined the process group (its "
                f"traceback is on stderr above). Usual causes: {fn.__name__} is not importable by name (define it at "
                f"module level, not inside a function or the `if __name__ == \"__main__\":` block), or an import "
                f"of the script failed in the new process")
    return None


def local_store(world: int, timeout: float) -> dist.TCPStore:
    """A rendezvous TCPStore listening on 127.0.0.1 only, on a port the OS picks (unreachable from
    the network; the callers seal it against the host's other users: distrain.sealed)."""
    return rendezvous.listening_store("127.0.0.1", 0, timedelta(seconds=timeout), world)


def local_env() -> dict[str, str]:
    """Environment for ranks of a local job: the top process to die with, Gloo on the loopback."""
    env = {lifeline.PARENT_ENV: os.environ.get(lifeline.PARENT_ENV, str(os.getpid()))}
    if "GLOO_SOCKET_IFNAME" not in os.environ and any(name == "lo" for _, name in socket.if_nameindex()):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


def default_threads(nprocs: int) -> int:
    """Each of ``nprocs`` unbound local ranks' torch threads: ``OMP_NUM_THREADS`` when it is set (torch's
    convention for a process's thread count: the machine's cores are shared with other work, e.g. two test
    processes on 2 cores, whose OpenMP threads would otherwise spin-wait on each other), else
    cpu_count // nprocs, at least 1."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given:
        if not given.isdigit() or int(given) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={given!r} is not a positive whole number of threads; set it to "
                              f"one (e.g. 1) or unset it (each rank then gets cpu_count // ranks)")
        return int(given)
    return max(1, (os.cpu_count() or 1) // nprocs)


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence = (), backend: str = "auto",
          timeout: float | None = 600.0, init_timeout: float | None = None, start_method: str = "forkserver",
          threads_per_rank: int | None = None, env: dict[str, str] | None = None, init: bool = True,
          bind_cores: bool | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` local ranks with an initialized process group.

    ``fn`` must be importable by name (a module-level function). ``timeout`` bounds the whole
    run (None: no limit); ``init_timeout`` (default: ``timeout``, or 300 s without one) bounds
    the rendezvous and each collective. ``threads_per_rank`` defaults to the cores of a bound rank,
    else ``OMP_NUM_THREADS`` when set, else cpu_count // nprocs (at least 1; :func:`default_threads`)
    so ranks do not fight for cores. ``env`` adds environment variables in the
    children. The ranks die with this process, whatever kills it (see distrain.lifeline).
    ``init=False`` leaves the process group to ``fn`` (torch.multiprocessing.spawn's contract):
    the launcher environment is set, so ``init_process_group("gloo")`` (env://) joins the
    parent's store.

    ``bind_cores`` pins each rank and its threads to cores of its own (:func:`core_slices`),
    as MPI does by default. ``None`` (the default) binds when the job's transport polls shared
    memory (``DISTRAIN_TRANSPORT`` shm or auto, in ``env`` or this environment) and P cores
    are free at the start (idle half of a 50 ms sample), to the freest ones (launch/cores.py):
    two ranks that poll must not share one core while another idles (4 KiB shm all_reduce at
    P=2: 12-22 us bound, 88-101 us not), but a rank bound to a core that other processes load
    cannot move away. Gloo is left unbound: with one core per rank its I/O threads then compete with the
    rank's own thread (4 KiB Gloo all_reduce: 1800-2400 us bound, 270-510 us not).
    ``True`` / ``False`` force it.

    ``args`` are shared, as with torch.multiprocessing.spawn: torch's pickling moves their CPU
    tensors (a module's parameters too) into shared memory, one storage for every rank and the
    caller. Right for read-only data; a rank that writes one or trains a module copies it first
    (``copy.deepcopy``, or bytes from ``torch.save``, as ``distrain.train(model=...)`` does).
    """
    _check_not_bootstrapping()
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if timeout is not None and not timeout > 0:
        raise ConfigError(f"spawn: timeout must be positive (or None for no limit), got {timeout}")
    runtime.resolve_backend(backend)
    init_timeout = init_timeout or timeout or 300.0
    if bind_cores is None:
        transport = (env or {}).get("DISTRAIN_TRANSPORT") or os.environ.get("DISTRAIN_TRANSPORT") or "torch"
        bind_cores = None if transport in ("shm", "auto") else False
    # None: bind when the transport polls shared memory and P cores are free right now (cores.py)
    slices = core_slices(nprocs) if bind_cores else free_core_slices(nprocs) if bind_cores is None else None
    if bind_cores and slices is None:
        raise ConfigError(f"spawn: bind_cores=True needs a core per rank, but {nprocs} ranks share "
                          f"{len(os.sched_getaffinity(0))} core(s); pass bind_cores=None or False")
    threads = threads_per_rank or (len(slices[0]) if slices else default_threads(nprocs))
    secret = sealed.new()  # this job's: other users of the host can reach its loopback store, not its keys
    store = sealed.SealedStore(local_store(nprocs, init_timeout), secret.encode())
    sup = Supervisor(start_method)
    setup = _Rendezvous(nprocs, store.port, backend, init_timeout, init, secret)
    for r in range(nprocs):
        sup.start(r, fn, args, env=local_env() | dict(env or {}), threads=threads,
                  cores=slices[r] if slices else None, setup=setup, title=rank_title(r, nprocs))

    results: dict[int, Any] = {}
    try:
        try:
            _collect(sup, results, timeout, lambda: runtime.joined_ranks(store, nprocs))
        except RankFailedError as e:
            hint = _early_death(fn, store, nprocs, sup.exitcode(e.rank), e.remote_message)
            if hint is None:
                raise
            raise RankFailedError(e.rank, hint) from None
    finally:
        # On success the ranks are shutting down by themselves; on failure end them now.
        if len(results) == nprocs:
            sup.join(10)
        sup.close()
        del store
    return [results[r] for r in range(nprocs)]


def _collect(sup: Supervisor, results: dict[int, Any], timeout: float | None, joined) -> None:
    """Wait for every rank's result; on failure, blame the rank that failed first.

    After the first failure we keep listening for BLAME_GRACE_S so that a rank killed by a
    signal is not out-raced by a survivor reporting the "connection reset" it caused.
    ``joined()``: the ranks that joined the process group (named in a time-out)."""
    nprocs = len(sup.procs)
    failures: dict[int, Failure] = {}
    deadline = None if timeout is None else time.monotonic() + timeout
    grace_end = None
    while len(results) + len(failures) < nprocs:
        limits = [t - time.monotonic() for t in (deadline, grace_end) if t is not None]
        outcomes = sup.poll(max(0.0, min(limits)) if limits else None)
        if not outcomes:  # (poll waits until an outcome or the nearest limit)
            if failures:
                break
            pending = [r for r in range(nprocs) if r not in results]
            never = [r for r in range(nprocs) if r not in joined()]
            raise SpawnTimeoutError(
                f"spawn: timed out after {timeout:g}s (the whole-run limit); rank(s) {pending} still running"
                + (f"; rank(s) {never} never joined the process group" if never else "")
                + " (a rank blocked in a collective its peers never called, or a slow job: raise the whole-run "
                  "limit, --timeout for distrain train, timeout= for spawn)"
            )
        for o in outcomes:
            if o.ident in results or o.ident in failures:
                continue
            if o.status == "ok":
                results[o.ident] = o.value
                continue
            failures[o.ident] = Failure(o.ident, o.when, o.value, secondary=o.secondary, died=o.status == "died",
                                        hang=o.status == "hang", exitcode=o.exitcode)
            if grace_end is None:
                grace_end = time.monotonic() + BLAME_GRACE_S
    if failures:
        raise blame(failures)
