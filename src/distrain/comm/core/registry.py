"""The one registry of collective algorithms, and the interface each one implements.

The dispatcher (api.py), the traffic model (algorithms/cost.py), the CLI/config validation
and the tests all read :data:`REGISTRY`. An algorithm is one module in ``comm/algorithms/``
implementing :class:`Algorithm` that calls :func:`register` on itself; the core never
imports an algorithm (the shared-memory transport asks for one by name, :func:`get`). ``"native"`` is not in the registry: it
means "the transport's own collective" (Gloo/NCCL for the torch transport, the direct
shared-memory collectives for the shm transport) and is handled by the dispatcher.

Buffer conventions every algorithm follows (the dispatcher prepares them):

* ranks are *group* ranks 0..P-1 of ``pc`` (a :class:`~distrain.comm.core.p2p.PeerComm`), and
  ``root`` is a group rank;
* ``buf``/``inp``/``out`` are flat contiguous 1-D tensors of n elements;
* ``full`` is a flat buffer of P*n elements, slot i = full[i*n:(i+1)*n] belongs to rank i
  (``None`` on ranks that do not hold it); all_gather's own slot is already filled;
* reductions fold contributions in a fixed order (deterministic results);
* non-root inputs of reduce/gather are not modified.
"""

from __future__ import annotations

from typing import Protocol

import torch

from distrain.comm.core.ops import Op
from distrain.comm.core.p2p import PeerComm
from distrain.errors import ConfigError

OPERATIONS = ("broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter")


class Algorithm(Protocol):
    """What an algorithm module provides: the seven collectives and their traffic model."""

    def broadcast(self, pc: PeerComm, buf: torch.Tensor, root: int) -> None: ...

    def reduce(self, pc: PeerComm, buf: torch.Tensor, root: int, op: Op) -> None: ...

    def all_reduce(self, pc: PeerComm, buf: torch.Tensor, op: Op) -> None: ...

    def scatter(self, pc: PeerComm, out: torch.Tensor, full: torch.Tensor | None, root: int) -> None: ...

    def gather(self, pc: PeerComm, inp: torch.Tensor, full: torch.Tensor | None, root: int) -> None: ...

    def all_gather(self, pc: PeerComm, full: torch.Tensor, n: int) -> None: ...

    def reduce_scatter(self, pc: PeerComm, out: torch.Tensor, full: torch.Tensor, op: Op) -> None: ...

    def traffic(self, coll: str, P: int, rank: int, count: int, root: int) -> tuple[int, int]:
        """(elements sent, elements received) by ``rank`` for one call of ``coll`` on P ranks
        (``count`` = N elements, or n per rank for the list collectives)."""
        ...


REGISTRY: dict[str, Algorithm] = {}  # filled by comm/algorithms/*.py as they are imported
NATIVE = "native"
P2P = "p2p"  # all_to_all_single's direct exchange on point-to-point (comm/alltoall.py); no other collective has it


def register(name: str, module) -> None:
    """Make ``module`` (implementing :class:`Algorithm`) the algorithm called ``name``."""
    missing = missing_functions(module)
    if missing:
        raise ConfigError(f"algorithm {name!r} ({module.__name__}) lacks {', '.join(missing)}")
    if name == NATIVE or (name in REGISTRY and REGISTRY[name] is not module):
        raise ConfigError(f"algorithm name {name!r} is taken")
    REGISTRY[name] = module


def names() -> tuple[str, ...]:
    """"native" then every registered algorithm, in registration order."""
    return (NATIVE, *REGISTRY)


def missing_functions(module) -> list[str]:
    """The names of :class:`Algorithm` that ``module`` lacks (empty when it conforms)."""
    return [f for f in (*OPERATIONS, "traffic") if not callable(getattr(module, f, None))]


def get(name: str, collective: str) -> Algorithm | None:
    """The algorithm called ``name`` (None for "native"), or a ConfigError listing the choices."""
    if name == NATIVE:
        return None
    alg = REGISTRY.get(name) if isinstance(name, str) else None
    if alg is None:
        raise ConfigError(f"{collective}: unknown algorithm {name!r}; use one of {', '.join(names())}")
    return alg
