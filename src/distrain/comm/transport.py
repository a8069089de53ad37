"""The transport: the one place where bytes leave this process.

Algorithms never call torch.distributed directly; they go through a :class:`Transport`
(via ``PeerComm``). Today the only transport is torch.distributed's own point-to-point
(Gloo over TCP on CPU, NCCL on GPU). A faster intra-node transport (shared memory,
CUDA IPC) can be added later by implementing these two methods, without touching the
star/ring/tree code.

Contract: ``isend``/``irecv`` take *global* ranks, a contiguous tensor and a tag, and return
a handle with ``wait()``. Messages between one pair of ranks with the same tag on the same
group are delivered in the order they were posted (true of Gloo and NCCL).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist


class Work(Protocol):
    def wait(self) -> bool | None: ...


class Transport(Protocol):
    name: str

    def isend(self, tensor: torch.Tensor, dst: int, group, tag: int) -> Work: ...

    def irecv(self, tensor: torch.Tensor, src: int, group, tag: int) -> Work: ...


class TorchTransport:
    """torch.distributed point-to-point: dist.isend / dist.irecv."""

    name = "torch"

    def isend(self, tensor: torch.Tensor, dst: int, group, tag: int) -> Work:
        return dist.isend(tensor, dst=dst, group=group, tag=tag)

    def irecv(self, tensor: torch.Tensor, src: int, group, tag: int) -> Work:
        return dist.irecv(tensor, src=src, group=group, tag=tag)


DEFAULT_TRANSPORT: Transport = TorchTransport()
