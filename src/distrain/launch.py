"""Starting ranks: ``spawn`` (local processes from Python) and ``launch`` (torchrun).

Seeds, "how processes start": either the user's code is the parent and forks a function
into sub-processes (torch.multiprocessing.spawn; here :func:`spawn`), or a launcher is the
parent and runs the whole script once per rank (torchrun; here :func:`launch`, which
delegates to torch's elastic launcher so multi-node rendezvous and restarts are torchrun's).

spawn's contract:

* the parent hosts the rendezvous TCPStore on a free port of 127.0.0.1 (bound by the OS,
  so there is no race for the port), starts ``nprocs`` processes, each of which sets the
  launcher environment variables, calls :func:`distrain.runtime.init` and then
  ``fn(rank, *args)``;
* it returns fn's return values in rank order (they must be picklable);
* if a rank raises (or dies), every other rank is ended and the parent raises
  :class:`RankFailedError` carrying that rank's number and traceback;
* if ``timeout`` seconds pass, every rank is ended and :class:`SpawnTimeoutError` names the
  ranks still running (and those that never joined the process group).
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from distrain import runtime
from distrain.errors import ConfigError, RankFailedError, SpawnTimeoutError


def _child(fn, rank: int, nprocs: int, port: int, args: tuple, backend: str, init_timeout: float,
           threads: int, conn, env: dict[str, str], init: bool = True) -> None:
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(nprocs),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the parent hosts the store
    })
    torch.set_num_threads(threads)
    try:
        if init:
            runtime.init(backend, timeout=init_timeout)
        payload = pickle.dumps(("ok", fn(rank, *args)))
    except BaseException:
        payload = pickle.dumps(("err", traceback.format_exc()))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
    runtime.shutdown()


def _died(code: int | None) -> str:
    msg = f"process exited with code {code} before returning"
    if code is not None and code < 0:
        msg += (f" (killed by signal {-code}; if the backend aborted, its message is on stderr above: "
                f"a collective mismatch across ranks is the usual cause, rerun with DISTRAIN_DEBUG=1 to find it)")
    return msg


def _is_fallout(text: str) -> bool:
    """A rank that failed only because a peer went away (its traceback is a comm error)."""
    return "CommError" in text or "Connection closed by peer" in text or "Connection reset by peer" in text


def _root_cause(r: int, text: str, conns, others: list[int], grace: float = 2.0) -> tuple[int, str]:
    """When rank r failed only because a peer vanished, wait briefly for the peer that raised
    first, so the error names the cause rather than its fallout."""
    if not _is_fallout(text):
        return r, text
    by_conn = {conns[q]: q for q in others}
    deadline = time.monotonic() + grace
    while by_conn and time.monotonic() < deadline:
        for c in mp.connection.wait(list(by_conn), timeout=max(0.0, deadline - time.monotonic())):
            q = by_conn.pop(c)
            try:
                status, value = pickle.loads(c.recv_bytes())
            except (EOFError, OSError):
                continue
            if status == "err" and not _is_fallout(value):
                return q, value
    return r, text


def _end(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 3
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def spawn(fn: Callable[..., Any], nprocs: int, args: Sequence = (), backend: str = "auto",
          timeout: float = 600.0, init_timeout: float | None = None, start_method: str = "forkserver",
          threads_per_rank: int | None = None, env: dict[str, str] | None = None, init: bool = True) -> list[Any]:
    """Run ``fn(rank, *args)`` on ``nprocs`` local ranks with an initialized process group.

    ``fn`` must be importable by name (a module-level function). ``timeout`` bounds the whole
    run; ``init_timeout`` (default: ``timeout``) bounds the rendezvous and each collective.
    ``threads_per_rank`` defaults to cpu_count // nprocs (at least 1) so ranks do not fight
    for cores. ``env`` adds environment variables in the children. ``init=False`` leaves the
    process group to ``fn`` (torch.multiprocessing.spawn's contract): the launcher environment
    is set, so ``init_process_group("gloo")`` (env://) joins the parent's store.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ConfigError(f"spawn: nprocs must be a positive int, got {nprocs!r}")
    if timeout <= 0:
        raise ConfigError(f"spawn: timeout must be positive, got {timeout}")
    runtime.resolve_backend(backend)
    threads = threads_per_rank or max(1, (os.cpu_count() or 1) // nprocs)
    store = dist.TCPStore("127.0.0.1", 0, nprocs, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(["distrain.comm", "distrain.launch"])

    procs, conns = [], []
    for r in range(nprocs):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, name=f"distrain-rank{r}", args=(
            fn, r, nprocs, store.port, tuple(args), backend, init_timeout or timeout, threads, send_end,
            dict(env or {}), init))
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)

    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < nprocs:
            pending = [r for r in range(nprocs) if r not in results]
            waitables = {conns[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
            ready = mp.connection.wait(list(waitables), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                joined = runtime.joined_ranks(store, nprocs)
                never = [r for r in range(nprocs) if r not in joined]
                raise SpawnTimeoutError(
                    f"spawn: timed out after {timeout:g}s; rank(s) {pending} still running"
                    + (f"; rank(s) {never} never joined the process group" if never else "")
                    + " (a rank blocked in a collective its peers never called, or a slow job: raise timeout=)"
                )
            for w in ready:
                r = waitables[w]
                if r in results:
                    continue
                conn = conns[r]
                if w is procs[r].sentinel and not conn.poll():
                    procs[r].join(1)
                    raise RankFailedError(r, _died(procs[r].exitcode))
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    procs[r].join(1)
                    raise RankFailedError(r, _died(procs[r].exitcode)) from None
                if status == "err":
                    raise RankFailedError(*_root_cause(r, value, conns, [q for q in pending if q != r]))
                results[r] = value
    finally:
        # On success the ranks are shutting down by themselves; on failure end them now.
        if len(results) == nprocs:
            for p in procs:
                p.join(10)
        _end(procs)
        for c in conns:
            c.close()
        del store
    return [results[r] for r in range(nprocs)]


def launch(nproc_per_node: int, script_args: Sequence[str], nnodes: int | str = 1, node_rank: int = 0,
           rdzv_endpoint: str | None = None, max_restarts: int = 0, rdzv_id: str = "distrain") -> int:
    """Run a script on every rank through torch's elastic launcher (torchrun).

    One node without an endpoint uses torchrun's --standalone rendezvous on a free port;
    several nodes use the c10d rendezvous at ``rdzv_endpoint`` (HOST:PORT of any one node).
    Returns the launcher's exit status (0 when every rank succeeded).
    """
    from torch.distributed import run as torchrun

    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
    if not script_args:
        raise ConfigError("launch: give the script to run, e.g. `distrain launch --nproc-per-node 2 train.py`")
    argv = [f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}"]
    if rdzv_endpoint:
        argv += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint={rdzv_endpoint}", f"--rdzv-id={rdzv_id}"]
    elif str(nnodes) != "1":
        raise ConfigError(f"--nnodes={nnodes} needs --rdzv-endpoint HOST:PORT (a host every node can reach)")
    else:
        argv.append("--standalone")
    argv += list(script_args)
    try:
        torchrun.main(argv)
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # torchrun raises ChildFailedError with every failed rank's traceback
        print(e)
        return 1
    return 0
