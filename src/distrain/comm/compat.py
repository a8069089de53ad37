"""Process-group management as torch.distributed spells it, so one import serves a torch user:

    import distrain.comm as dist
    dist.init_process_group("gloo")            # env:// under torchrun / distrain launch / spawn(init=False)
    g = dist.new_group([0, 1]); dist.all_reduce(t, group=g, algorithm="ring")
    dist.destroy_process_group()

The group objects are torch.distributed's own, so a group made here works with
torch.distributed and the reverse. What distrain adds: ``init_process_group`` reads
``DISTRAIN_DEBUG`` like :func:`distrain.runtime.init` (the one place it is read), and
``destroy_process_group`` also forgets distrain's per-group state (sequence numbers,
worker threads), so a later group with the same ranks starts its tags from the beginning.
Everything else is torch.distributed's function itself (same object), listed in ``PASSTHROUGH``.
"""

from __future__ import annotations

import importlib
import os

import torch.distributed as dist

from distrain.comm import api

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
    api.set_debug(os.environ.get("DISTRAIN_DEBUG", "0") not in ("", "0", "false", "False"))


def destroy_process_group(group=None) -> None:
    """Destroy ``group`` (None: every group, as torch) and drop distrain's state for it."""
    # by module path: distrain.comm.group is, as an attribute, torch's `group` (group.WORLD)
    mod = importlib.import_module("distrain.comm.group")
    states = getattr(mod, "_states", None)
    if states is not None:
        with mod._states_lock:
            if group is None:
                states.clear()
            else:
                states.pop(group, None)
    dist.destroy_process_group(group)
