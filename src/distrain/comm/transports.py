"""Transports: the one place where bytes leave this process, chosen per group.

Algorithms never call torch.distributed directly; they go through the :class:`Transport` of
their group (via ``PeerComm``), and so do the public ``send``/``recv``. Which transport a
group uses is decided once, on its first use, from (first that applies):

1. ``distrain.comm.set_transport(t, group)`` for that group: a name or any object
   implementing :class:`Transport` (injectable, e.g. a fake for tests);
2. the job-wide default, ``distrain.comm.set_default_transport(name)``, which
   ``distrain.runtime.init`` sets from ``DISTRAIN_TRANSPORT``;
3. ``"torch"``.

Names: ``"torch"`` is torch.distributed's point-to-point (Gloo over TCP on CPU, NCCL on GPU).

Contract: ``isend``/``irecv`` take *global* ranks, a contiguous tensor and a tag, and return
a handle with ``wait()``. Messages between one pair of ranks with the same tag on the same
group are delivered in the order they were posted (true of Gloo and NCCL).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from distrain.errors import ConfigError


class Work(Protocol):
    def wait(self) -> bool | None: ...


@runtime_checkable
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

    def close(self) -> None:
        pass


TORCH = TorchTransport()
TRANSPORT_NAMES: tuple[str, ...] = ("torch",)

_default = "torch"


def check_name(name, where: str) -> str:
    if name not in TRANSPORT_NAMES:
        raise ConfigError(f"{where}: unknown transport {name!r}; use one of {', '.join(TRANSPORT_NAMES)}")
    return name


def set_default_transport(name: str) -> None:
    """The transport of every group that is not given one with ``set_transport`` (job-wide)."""
    global _default
    _default = check_name(name, "set_default_transport")


def default_transport() -> str:
    return _default


def build(choice, state) -> Transport:
    """The transport object for a group's ``choice`` (a name, or a Transport used as is)."""
    if not isinstance(choice, str):
        if not isinstance(choice, Transport):
            raise ConfigError(f"set_transport: {choice!r} is neither a transport name ({', '.join(TRANSPORT_NAMES)}) "
                              f"nor an object with name, isend(tensor, dst, group, tag) and irecv(...)")
        return choice
    check_name(choice, "set_transport")
    return TORCH
