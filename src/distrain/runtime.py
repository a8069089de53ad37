"""Process-group start-up for one rank: backend choice, rendezvous, device.

Words (seeds): a *node* is a machine; the *world size* W is the number of processes in
the job; each process has a global *rank* 0..W-1 and a *local rank* 0..(processes on its
node)-1, which picks its GPU.

``init()`` reads what a launcher put in the environment (and ``DISTRAIN_DEBUG=1``, which turns
on the cross-rank argument checks of distrain.comm) (torchrun / ``distrain launch``
set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; ``distrain.spawn`` sets the
same for its children), so it is called once at the top of a script, never deep inside
models. Rendezvous goes through a TCPStore at MASTER_ADDR:MASTER_PORT. Before creating the
process group every rank registers itself in the store and waits for the others, so a
rank that never joins gives an error naming it instead of an anonymous time-out.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import CommError, ConfigError

REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH_HINT = (
    "start the script with `distrain launch --nproc-per-node N script.py` (or `torchrun "
    "--nproc-per-node N script.py`), or run a function on N local ranks with distrain.spawn(fn, N)"
)


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


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={os.environ[name]!r} is not an integer") from None


def init(backend: str = "auto", timeout: float | timedelta = 300.0) -> RuntimeInfo:
    """Initialize the default process group from the launcher's environment (idempotent).

    ``timeout`` (seconds) bounds the rendezvous and every later collective of the group.
    """
    if dist.is_initialized():
        return info()
    missing = [k for k in REQUIRED_ENV if k not in os.environ]
    if missing:
        raise ConfigError(f"distrain.runtime.init: environment variable(s) {', '.join(missing)} not set; {LAUNCH_HINT}")
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    if not 0 <= rank < world:
        raise ConfigError(f"RANK={rank} is outside [0, WORLD_SIZE={world})")
    local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank
    backend = resolve_backend(backend)
    secs = _seconds(timeout)
    addr, port = os.environ["MASTER_ADDR"], _env_int("MASTER_PORT")

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    # Under torchrun (and distrain.spawn) the launcher already hosts the store; else rank 0 does.
    hosts_store = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        store = dist.TCPStore(addr, port, world, is_master=hosts_store, timeout=timedelta(seconds=secs),
                              wait_for_workers=False)
    except Exception as e:
        raise CommError(
            f"rank {rank}: cannot reach the rendezvous store at {addr}:{port} within {secs:g}s ({e}); "
            f"check that rank 0 / the launcher is running and that every rank has the same MASTER_ADDR and MASTER_PORT"
        ) from e
    # A restarted job (torchrun --max-restarts) reuses the store: keep each attempt's keys apart.
    prefix = f"distrain/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    _wait_for_all(store, prefix, rank, world, secs, f"{addr}:{port}")
    dist.init_process_group(backend, store=dist.PrefixStore(prefix + "pg", store), rank=rank,
                            world_size=world, timeout=timedelta(seconds=secs))
    # The one place the debug switch is read from the environment (never deep inside comm).
    comm.set_debug(os.environ.get("DISTRAIN_DEBUG", "0") not in ("", "0", "false", "False"))
    comm.set_default_transport(os.environ.get("DISTRAIN_TRANSPORT") or "torch")  # the whole job's transport
    return info()


def _wait_for_all(store, prefix: str, rank: int, world: int, secs: float, where: str) -> None:
    store.set(f"{prefix}joined/{rank}", "1")
    keys = [f"{prefix}joined/{r}" for r in range(world)]
    deadline = time.monotonic() + secs
    delay = 0.005
    while not store.check(keys):
        if time.monotonic() > deadline:
            absent = [r for r, k in enumerate(keys) if not store.check([k])]
            raise CommError(
                f"rank {rank}: timed out after {secs:g}s waiting for rank(s) {absent} to join the process group "
                f"(world size {world}, store {where}); they never started or crashed before init. {LAUNCH_HINT}"
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
    """Destroy the default process group if there is one."""
    if dist.is_initialized():
        dist.destroy_process_group()
