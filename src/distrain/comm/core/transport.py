"""Transports: the one place where bytes leave this process, chosen per group.

Algorithms never call torch.distributed directly; they go through the :class:`Transport` of
their group (via ``PeerComm``), and so do the public ``send``/``recv``. Which transport a
group uses is decided once, on its first use, from (first that applies):

1. ``distrain.comm.set_transport(t, group)`` for that group: a name or any object
   implementing :class:`Transport` (injectable, e.g. a fake for tests);
2. the job-wide default, ``distrain.comm.set_default_transport(name)``, which
   ``distrain.runtime.init`` sets from ``DISTRAIN_TRANSPORT``;
3. ``"torch"``.

Names:

* ``"torch"``: torch.distributed's point-to-point (Gloo over TCP on CPU, NCCL on GPU), and
  its native collectives;
* ``"shm"``: shared memory between the ranks of this host (comm/shm/); every rank of the
  group must be on this host; native collectives are the direct shared-memory ones;
* ``"auto"``: shared memory with the peers on this host and torch with the others (decided
  per peer through the store); native all_reduce of a group spread over several hosts is
  hierarchical (shm/hierarchy.py), other native collectives of such a group are torch's.
  On a machine where shared memory is not supported (not x86-64, no /dev/shm), ``auto``
  is ``torch``.

The core does not import the shared-memory transport: comm/shm/ registers a factory here
(:func:`register_shm`), so the dependency runs from shm to the core only.

A transport that holds memory its waits read (shm) also has ``interrupt()`` (end every wait on the
group, on every rank: core/group.py interrupt_group) and ``unlink()`` (remove its files, keep its
mappings); torch's has neither (Gloo has no abort: an elastic rank shuts its sockets down instead).

Contract: ``isend``/``irecv`` take *global* ranks, a contiguous tensor and a tag, and return
a handle with ``wait()``. Messages between one pair of ranks with the same tag on the same
group are delivered in the order they were posted (true of Gloo and NCCL).
"""

from __future__ import annotations

import logging
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

    def direct(self, collective: str):
        """The transport's own algorithm for ``collective`` when ``algorithm="native"``, or None
        for torch.distributed's native collective."""
        return None

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


TORCH = TorchTransport()
TRANSPORT_NAMES: tuple[str, ...] = ("auto", "shm", "torch")

_default = "torch"
_timeout = 300.0  # seconds a shared-memory wait may take (the process group's timeout)


log = logging.getLogger("distrain.comm")
_fallbacks_said: set[str] = set()
_shm_factory = None  # set by comm/shm/__init__.py: (supported() -> str | None, make(state, timeout, strict, fallback))


def register_shm(unsupported, make) -> None:
    """Called once by the shared-memory package: ``unsupported()`` gives None when this host
    can use shared memory, else the reason; ``make(...)`` builds a group's transport."""
    global _shm_factory
    _shm_factory = (unsupported, make)


def check_name(name, where: str) -> str:
    if name not in TRANSPORT_NAMES:
        raise ConfigError(f"{where}: unknown transport {name!r}; use one of {', '.join(TRANSPORT_NAMES)}")
    return name


def set_default_transport(name: str, timeout: float | None = None) -> None:
    """The transport of every group not given one with ``set_transport`` (job-wide), and the
    time-out of shared-memory waits in seconds (``distrain.runtime.init`` passes its own)."""
    global _default, _timeout
    _default = check_name(name, "set_default_transport")
    if timeout is not None:
        if not timeout > 0:
            raise ConfigError(f"set_default_transport: timeout must be a positive number of seconds, got {timeout!r}")
        _timeout = float(timeout)


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
    if choice == "torch":
        return TORCH
    why = "distrain.comm.shm is not loaded" if _shm_factory is None else _shm_factory[0]()
    if why is not None:
        if choice == "auto":
            if why not in _fallbacks_said:  # once per reason and process
                _fallbacks_said.add(why)
                log.warning("transport 'auto' uses torch's point-to-point here: shared memory cannot be used (%s)",
                            why)
            return TORCH
        raise ConfigError(f"transport 'shm' cannot be used here: {why}; use transport 'torch' or 'auto'")
    return _shm_factory[1](state, _timeout, strict=choice == "shm", fallback=TORCH)
