"""Process-group start-up for one rank: backend choice, rendezvous, device.

Words (seeds): a *node* is a machine; the *world size* W is the number of processes in
the job; each process has a global *rank* 0..W-1 and a *local rank* 0..(processes on its
node)-1, which picks its GPU.

``init()`` reads what a launcher put in the environment (and distrain.comm's switches,
``DISTRAIN_DEBUG``, ``DISTRAIN_TRANSPORT``, ``DISTRAIN_SHM_KERNELS``: comm.configure_from_env) (torchrun / ``distrain launch``
set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; ``distrain.spawn`` sets the
same for its children), so it is called once at the top of a script, never deep inside
models. Rendezvous goes through a TCPStore at MASTER_ADDR:MASTER_PORT, sealed with the job's secret
when the launcher gave one (``DISTRAIN_JOB_SECRET``: distrain.spawn, ``distrain launch`` and the elastic
coordinator always do; see distrain.sealed). Before creating the
process group every rank registers itself in the store and waits for the others, so a
rank that never joins gives an error naming it instead of an anonymous time-out.

``init`` also registers :func:`shutdown` to run at interpreter exit (atexit, i.e. *before*
finalization starts). A rank started by a launcher ends through ordinary interpreter exit
(``distrain.spawn``'s ranks leave through ``os._exit`` and never finalize). If the process
group were still alive then, a C++ thread could need the GIL during finalization: a Gloo
worker thread drops the last reference to a finished collective's work, whose tensors'
Python objects it must release (seen in a core dump: ``~AsyncAllgatherWork`` ->
``TensorImpl::decref_pyobject`` -> ``gil_scoped_acquire``), or the watchdog thread comes back
from ``store.set``. CPython ends such a thread with ``pthread_exit``; the forced unwinding
meets a noexcept C++ frame and libstdc++ aborts the rank ("terminate called without an
active exception", exit -6). Destroying the group joins Gloo's threads only once nothing
else references it (a DDP module, a model-parallel engine may), so the command-line entry
points end a launched rank with :func:`leave` instead: atexit callbacks, flushed stdio, then
``os._exit``, as multiprocessing's children do; finalization never runs.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from distrain import comm, entry, lifeline, rendezvous, sealed
from distrain.comm.core import reach, watchdog
from distrain.errors import CommError, ConfigError
from distrain.entry import env_int, leave  # noqa: F401  (leave: runtime.leave, the entry points' end)

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
HANDSHAKE_S = 20.0  # a port that accepts connections but has not answered as a store by then is something else
LAUNCH_HINT = (
    "start the script with `distrain launch --nproc-per-node N script.py` (or `torchrun "
    "--nproc-per-node N script.py`), or run a function on N local ranks with distrain.spawn(fn, N)"
)
REACH_HINT = "check that rank 0 / the launcher is running and that every rank has the same MASTER_ADDR and MASTER_PORT"


@dataclass(frozen=True)
class RuntimeInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("backend 'nccl' needs CUDA GPUs and none is visible; use backend='gloo' on CPU")
    return backend


def _seconds(timeout: float | timedelta) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def launched_rank(environ: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """(rank, world size) when a launcher (``distrain launch``, torchrun, ``distrain cluster run``,
    ``distrain.spawn``) started this process as one rank of a job, i.e. ``environ`` (default: this
    process's environment) holds both RANK and WORLD_SIZE; None for a top process (one that
    spawns its ranks, or runs alone). The one answer to "am I a launched rank?": read here, at the
    process edge, and passed down (:func:`distrain.entry.launched_rank`, torch-free, answers for a given
    mapping). ConfigError when either is not an integer."""
    return entry.launched_rank(os.environ if environ is None else environ)


FASHION_MNIST_ENV = "DISTRAIN_FASHION_MNIST"  # the Fashion-MNIST folder, when not the default (data.images)


def validate_args(environ: Mapping[str, str] | None = None) -> dict:
    """What :meth:`distrain.trainer.TrainConfig.validate` takes from the process's environment
    (default: this process's), read at the edge: ``launched`` (:func:`launched_rank`) and
    ``fashion_mnist_root`` ($DISTRAIN_FASHION_MNIST, None when unset)."""
    environ = os.environ if environ is None else environ
    return {"launched": launched_rank(environ), "fashion_mnist_root": environ.get(FASHION_MNIST_ENV)}


def available_memory(meminfo: str = "/proc/meminfo") -> float | None:
    """Bytes of memory this host can give new processes without swapping (the kernel's MemAvailable),
    read here, at the process edge; None where the file or the field is missing (not Linux)."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


INJECT_ENV = "DISTRAIN_INJECT"  # a fault to inject, for tests: bitflip:STEP:RANK (distrain.trainer.replicas)


def injected_fault(environ: Mapping[str, str] | None = None) -> str | None:
    """$DISTRAIN_INJECT of ``environ`` (default: this process's), None when unset: read here, at the
    process edge; ``distrain.train`` parses it (trainer/replicas.py parse_inject) and passes it to its ranks."""
    environ = os.environ if environ is None else environ
    return environ.get(INJECT_ENV)


def init(backend: str = "auto", timeout: float | timedelta = 300.0,
         on_hang: Callable[[str], None] | None = None) -> RuntimeInfo:
    """Initialize the default process group from the launcher's environment (idempotent).

    ``timeout`` (seconds) bounds the rendezvous and every later collective of the group: a
    rank blocked longer in one call is stopped by the collective watchdog
    (distrain.comm.core.watchdog), which names the ranks that did not arrive and hands that report
    to ``on_hang`` (default: stderr) before exiting; a rank whose heartbeats stop is named sooner,
    within 2 s of the first call that waits on it. The backend's own time-out is set a little
    longer so that the watchdog's report comes first.
    """
    if dist.is_initialized():
        return info()
    missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"distrain.runtime.init: environment variable(s) {', '.join(missing)} not set; {LAUNCH_HINT}")
    rank, world = env_int("RANK", os.environ), env_int("WORLD_SIZE", os.environ)
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    local_rank = env_int("LOCAL_RANK", os.environ) if "LOCAL_RANK" in os.environ else rank
    backend = resolve_backend(backend)
    secs = _seconds(timeout)
    addr, port = os.environ["MASTER_ADDR"], env_int("MASTER_PORT", os.environ)

    if lifeline.PARENT_ENV in os.environ:  # started by distrain: die with the top process, leave Ctrl-C to it
        lifeline.die_with_parent()
        lifeline.quiet_interrupts()
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    # Under torchrun (and distrain.spawn) the launcher already hosts the store; else rank 0 does.
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    secret = sealed.check(os.environ[sealed.ENV]) if sealed.ENV in os.environ else None
    store = sealed.seal(_connect_store(addr, port, world, rank, hosts_store, secs), secret)
    _held.append(store)  # (a store written in Python must outlive the C++ PrefixStores that call it: shutdown)
    # A restarted job (torchrun --max-restarts) reuses the agent's store: keep each attempt's keys apart. A store
    # of our rank 0 is new for every attempt, and the restart count is per node (a node restarted for a membership
    # change does not count it: pytorch/pytorch#108158), so across nodes only the constant prefix agrees.
    agents = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") if agents else "0"
    prefix = f"distrain/{attempt}/"
    _wait_for_all(store, prefix, rank, world, secs, f"{addr}:{port}")
    dist.init_process_group(backend, store=dist.PrefixStore(prefix + "pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=secs + max(30.0, secs / 5)))
    # Gloo connects its full mesh inside init_process_group, and a rank can finish its side of it before a peer
    # has: a rank that then returned and exited at once closed its sockets under the peer's connect ("Connection
    # closed by peer" in connectFullMesh, seen with distrain.spawn of a function that returns right away). No rank
    # leaves init before every rank has its group.
    _wait_for_all(store, prefix, rank, world, secs, f"{addr}:{port}", stage="connected")
    # heartbeats every BEAT_S over the watchdog's own connection: a rank that stops answering is named within 2 s
    # and a listener on this rank's address that its kernel answers, so a peer tells a cut link from a starved rank
    watchdog.install(store, rank, world, secs, on_hang, interval=watchdog.BEAT_S, quiet_s=watchdog.QUIET_S,
                     connect=lambda: _heartbeat_store(addr, port, secret), prefix=prefix,
                     listen=_own_address(addr, port))
    atexit.unregister(shutdown)  # once, however often init/shutdown alternate
    atexit.register(shutdown)  # before finalization: see the module docstring
    comm.configure_from_env(secs)  # debug checks, transport, shm kernels: read here, never deep inside comm
    return info()


def _own_address(addr: str, port: int) -> str | None:
    """The address this rank's packets to the store leave from (its probe listener's: reach.py); None when it
    cannot be told (then a cut-off rank is named only by the time-out or once its process is gone)."""
    try:
        return reach.local_address(addr, port)
    except OSError:
        return None


def _heartbeat_store(addr: str, port: int, secret: bytes | None) -> dist.Store:
    """The collective watchdog's own connection to the job's store, sealed like the job's: a store client
    runs one call at a time, so on the main connection a heartbeat would wait behind any wait of the main
    thread. Its time-out (connect, and reads of a key not there) is short. (No PrefixStore over it: C++
    would hold only the C++ half of a sealed store; the watchdog prefixes its keys itself.)"""
    client = dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=watchdog.STORE_S),
                           wait_for_workers=False)
    return sealed.seal(client, secret)


def _connect_store(addr: str, port: int, world: int, rank: int, hosts_store: bool, secs: float):
    """The rendezvous store client (or server, for rank 0 without a launcher).

    A client first waits, in this thread, until the port accepts a TCP connection (the store may
    start later), for at most ``secs``: TCPStore's own client retries a refused port with a
    randomized back-off that ran to twice ``secs`` (41 s for 20 s), and a thread of ours still
    inside that C++ call when the process ends aborts it (:func:`_abandon`). Then the client is
    built on a helper thread while we watch, because it waits forever for the answer of a port
    that accepts and stays silent: the store has HANDSHAKE_S to answer, else MASTER_PORT points
    at another service."""
    where = f"{addr}:{port}"
    deadline = time.monotonic() + secs
    if not hosts_store:
        _wait_until_accepting(addr, port, rank, secs, deadline)
    result: dict = {}

    def make() -> None:
        try:
            if hosts_store:  # on MASTER_ADDR's address only (TCPStore alone would bind every interface)
                result["store"] = rendezvous.listening_store(addr, port, timedelta(seconds=secs), world)
                if result["store"] is not None:
                    return
                print(f"distrain: rank 0: MASTER_ADDR {addr} is no address of this machine (or port {port} is taken "
                      f"there); its store listens on every interface", file=sys.stderr, flush=True)
            result["store"] = dist.TCPStore(addr, port, world, is_master=hosts_store, timeout=timedelta(seconds=secs),
                                            wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - reported below with the address
            result["error"] = e

    helper = threading.Thread(target=make, name="distrain-store-connect", daemon=True)
    helper.start()
    answer_by = None if hosts_store else time.monotonic() + min(HANDSHAKE_S, secs)
    while helper.is_alive():
        helper.join(0.2)
        now = time.monotonic()
        if helper.is_alive() and answer_by is not None and now > answer_by:
            _abandon(helper)
            raise CommError(f"rank {rank}: MASTER_ADDR:MASTER_PORT {where} accepts connections but does not answer "
                            f"as a torch.distributed store (no reply in {min(HANDSHAKE_S, secs):g}s); MASTER_PORT "
                            f"points at another service: give the port of the launcher's or rank 0's store")
        if helper.is_alive() and now > deadline + 5:
            _abandon(helper)
            break
    if "store" not in result:
        e = result.get("error", f"no answer in {secs:g}s")
        raise CommError(
            f"rank {rank}: cannot reach the rendezvous store at {where} within {secs:g}s "
            f"({str(e).splitlines()[0][:200]}); {REACH_HINT}"
        ) from (e if isinstance(e, BaseException) else None)
    return result["store"]


def _wait_until_accepting(addr: str, port: int, rank: int, secs: float, deadline: float) -> None:
    """Return once ``addr:port`` accepts a TCP connection; CommError saying why not after ``secs``."""
    delay, error = 0.05, None
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            error = e
        left = deadline - time.monotonic()
        if left <= 0:
            break
        time.sleep(min(delay, left))
        delay = min(2 * delay, 0.5)
    if isinstance(error, ConnectionRefusedError):
        why = "connection refused: nothing listens on that port"
    elif isinstance(error, socket.gaierror):
        why = f"cannot resolve the host name {addr!r}: {error.strerror}"
    elif isinstance(error, (TimeoutError, socket.timeout)):
        why = "a TCP connect gets no answer: the host is down or a firewall drops the packets"
    else:
        why = (getattr(error, "strerror", None) or str(error))[:200]
    raise CommError(f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within {secs:g}s ({why}); "
                    f"{REACH_HINT}")


_abandoned: list[threading.Thread] = []
# The group's store while the group lives. A SealedStore is a Python object that torch's C++ PrefixStore
# (the group's, the watchdog's) calls back into; C++ keeps only its C++ half alive, and once the Python
# object is collected a call fails ("Not implemented"), so this process holds it until shutdown().
_held: list = []


_leave_hooks: list = []  # the excepthooks _abandon installed (one, unless something replaced it since)


def _abandon(helper: threading.Thread) -> None:
    """``helper`` is still inside torch's C++ store client and cannot be stopped. Should it return
    while the interpreter finalizes, it asks for the GIL, CPython ends it with ``pthread_exit`` and
    libstdc++ aborts the process ("terminate called without an active exception", exit 134; see
    the module docstring). So from now on an uncaught exception in the main thread (the usual end
    of a script whose ``init`` raised) is printed as usual and the process ends through
    :func:`leave` with status 1, the interpreter's, skipping finalization. (The CLI's launched ranks
    always leave that way: distrain.cli.run_command.)"""
    _abandoned.append(helper)
    if sys.excepthook in _leave_hooks:
        return
    previous = sys.excepthook

    def leave_after_printing(kind, value, tb) -> None:
        previous(kind, value, tb)
        if any(t.is_alive() for t in _abandoned):
            leave(1)

    _leave_hooks.append(leave_after_printing)
    sys.excepthook = leave_after_printing


def _wait_for_all(store, prefix: str, rank: int, world: int, secs: float, where: str, stage: str = "joined") -> None:
    """Mark this rank at ``stage`` in the store and wait until every rank is there (CommError naming the absent
    ones past ``secs``): "joined" before the process group is made, "connected" after it is."""
    store.set(f"{prefix}{stage}/{rank}", "1")
    keys = [f"{prefix}{stage}/{r}" for r in range(world)]
    deadline = time.monotonic() + secs
    delay = 0.005
    while not store.check(keys):
        if time.monotonic() > deadline:
            absent = [r for r, k in enumerate(keys) if not store.check([k])]
            raise CommError(
                f"rank {rank}: timed out after {secs:g}s waiting for rank(s) {absent} to "
                + ("join the process group" if stage == "joined" else "finish connecting the process group")
                + f" (world size {world}, store {where}); they never started or crashed "
                + ("before init" if stage == "joined" else "inside init") + f". {LAUNCH_HINT}"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.1)


def joined_ranks(store, world: int, restart: int = 0) -> list[int]:
    """Ranks that registered in ``store`` (used by spawn to explain a time-out)."""
    return [r for r in range(world) if store.check([f"distrain/{restart}/joined/{r}"])]


def info() -> RuntimeInfo:
    if not dist.is_initialized():
        raise ConfigError(f"torch.distributed is not initialized; call distrain.runtime.init() first ({LAUNCH_HINT})")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return RuntimeInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank,
                       local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())),
                       backend=backend, device=device)


def shutdown() -> None:
    """Stop the collective watchdog (waiting for its thread) and destroy the default process
    group if there is one (Gloo joins its worker threads once their collectives finished).
    Idempotent; runs at interpreter exit after :func:`init`."""
    watchdog.uninstall()
    if dist.is_initialized():
        comm.close_all()  # shared-memory segments go with the groups
        dist.destroy_process_group()
    _held.clear()
