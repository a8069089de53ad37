"""Process-group management as torch.distributed spells it, so one import serves a torch user:

    import distrain.comm as dist
    dist.init_process_group("gloo")            # env:// under torchrun / distrain launch / spawn(init=False)
    g = dist.new_group([0, 1]); dist.all_reduce(t, group=g, algorithm="ring")
    dist.destroy_process_group()

The group objects are torch.distributed's own, so a group made here works with
torch.distributed and the reverse. What distrain adds: ``init_process_group`` reads
distrain.comm's switches from the environment (:func:`configure_from_env`) as
:func:`distrain.runtime.init` does, and
``destroy_process_group`` also frees distrain's per-group state (sequence numbers,
worker threads, transports), so a later group with the same ranks starts afresh.
Everything else is torch.distributed's function itself (same object), listed in ``PASSTHROUGH``.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from distrain.comm import api
from distrain.comm.core.group import close_all, close_group
from distrain.comm.core.transport import set_default_transport
from distrain.comm.shm.compiled import set_kernels

PASSTHROUGH = (
    "is_available", "is_initialized", "is_gloo_available", "is_nccl_available", "is_mpi_available",
    "is_torchelastic_launched", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "get_rank",
    "get_world_size", "get_process_group_ranks", "get_backend", "get_global_rank", "get_group_rank",
    "get_node_local_rank", "monitored_barrier", "ReduceOp", "Backend", "GroupMember", "group",
    "ProcessGroup", "Store", "TCPStore", "FileStore", "HashStore", "PrefixStore", "Work", "DistBackendError",
)


def init_process_group(backend: str | None = None, init_method: str | None = None, timeout=None,
                       world_size: int = -1, rank: int = -1, store=None, group_name: str = "", **kwargs) -> None:
    """torch.distributed.init_process_group, plus distrain's debug switch from DISTRAIN_DEBUG."""
    dist.init_process_group(backend, init_method=init_method, timeout=timeout, world_size=world_size,
                            rank=rank, store=store, group_name=group_name, **kwargs)
    configure_from_env(timeout.total_seconds() if timeout is not None else 300.0)


def configure_from_env(timeout_s: float) -> None:
    """distrain.comm's job-wide switches, from the environment a launcher passes down. The only place
    comm reads the environment, and only at a process's start: ``distrain.runtime.init`` and this module's
    ``init_process_group`` (torch's own counterpart reads MASTER_ADDR and the rest there too):

    * ``DISTRAIN_DEBUG=1``: the cross-rank fingerprint check before every collective;
    * ``DISTRAIN_TRANSPORT``: torch (default), shm or auto, with ``timeout_s`` for shm waits;
    * ``DISTRAIN_SHM_KERNELS``: auto (default), compiled or python (comm/shm/compiled.py).
    """
    api.set_debug(os.environ.get("DISTRAIN_DEBUG", "0") not in ("", "0", "false", "False"))
    set_default_transport(os.environ.get("DISTRAIN_TRANSPORT") or "torch", timeout=timeout_s)
    set_kernels(os.environ.get("DISTRAIN_SHM_KERNELS") or "auto")


def destroy_process_group(group=None) -> None:
    """Destroy ``group`` (None: every group, as torch) after freeing distrain's state for it
    (sequence numbers, worker thread, transport such as shared-memory segments)."""
    if group is None:
        close_all()
    else:
        close_group(group)
    dist.destroy_process_group(group)
