"""A group's transport, and tensors in its symmetric memory.

``set_transport(transport, group)`` chooses how ``group``'s messages travel (before its first one: a name from
``TRANSPORT_NAMES``, "torch" or "shm", or any object implementing ``core/transport.py``'s ``Transport``);
``transport_of(group)`` names the one it uses. On the shared-memory transport (one host) a tensor can live in
*symmetric memory*, which every peer maps: ``symmetric_empty`` makes one, collectively, and ``symmetric_peer``
reads a peer's counterpart in place (torch's ``_symmetric_memory``, NCCL's registered buffers). Where the group
has no such memory every rank gets ordinary memory and ``symmetric_peer`` says None, so code written for it runs
anywhere.
"""

from __future__ import annotations

import logging

import torch

from distrain.comm.core.group import resolve

_log = logging.getLogger("distrain.comm")


def symmetric_empty(*size, dtype: torch.dtype = torch.float32, group=None) -> torch.Tensor:
    """An uninitialised tensor in *symmetric memory*: every rank of ``group`` calls this in the
    same order with the same size, and each peer maps the others' copies, so ``all_reduce`` on it
    (native algorithm) works in place in every rank's memory: no copy into the transport's slots
    and back (shm/symmetric.py; torch's ``_symmetric_memory.empty``, NCCL's registered buffers).
    Every rank must then pass its counterpart (same allocation, same offset) to the collective.

    Where the group has no shared-memory transport (transport torch, ranks on several hosts,
    one rank) or /dev/shm cannot hold it, every rank gets ordinary memory (said once in the log):
    code written for it runs anywhere, only the fast path is lost. Lives as long as the group.
    """
    name = "symmetric_empty"
    st = resolve(group, name)
    shape = torch.Size(size[0] if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size)
    alloc = getattr(st.transport, "symmetric_empty", None) if st.size > 1 else None
    if alloc is not None:
        raw, why = alloc(shape.numel() * dtype.itemsize)
        if raw is not None:
            return raw.view(dtype).view(shape)
        _log.warning("%s: ordinary memory on rank %d (group of %d ranks): %s", name, st.ranks[st.rank], st.size, why)
    return torch.empty(shape, dtype=dtype)


def symmetric_peer(t: torch.Tensor, rank: int, group=None) -> torch.Tensor | None:
    """Rank ``rank``'s (of ``group``) counterpart of ``t``, a tensor :func:`symmetric_empty` made: a uint8
    view of the same bytes in that peer's memory, mapped here (read it while the group lives: the mapping goes
    with the group's transport), or None where ``t`` is not in symmetric memory (ordinary memory: no shared-
    memory transport, several hosts, /dev/shm full)."""
    st = resolve(group, "symmetric_peer")
    peer = getattr(st.transport, "symmetric_peer", None) if st.size > 1 else None
    return peer(t, rank) if peer is not None else None


def set_transport(transport, group=None) -> None:
    """Choose the transport of ``group`` (None = the world) before its first message: a name
    from ``TRANSPORT_NAMES`` or any object implementing ``transports.Transport``."""
    resolve(group, "set_transport").set_transport(transport)


def transport_of(group=None) -> str:
    """The name of the transport ``group`` uses (building it if this is its first use)."""
    return resolve(group, "transport_of").transport.name
