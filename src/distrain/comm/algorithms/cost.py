"""Traffic model: the exact bytes each rank sends and receives, per collective and algorithm.

These are closed forms derived from the schedules in star.py, ring.py and tree.py (their
docstrings give the schedules); the ledger must equal them byte for byte (tested). They
reduce to the seeds' formulas for an all-reduce of N bytes on P ranks:

* star (master-worker): the root sends and receives (P-1)*N; a worker N each way;
* ring: every rank sends and receives 2*(N/P)*(P-1) (when P divides N);
* tree: the root sends and receives ceil(log2 P)*N; an inner node N*(children + 1).

Notation: P ranks, rank r, root rho, position v = (r - rho) mod P; N elements of ``elem``
bytes for single-tensor collectives; n elements per rank (full buffer P*n) for the list
collectives; c_i = size of chunk i of ``torch.tensor_split`` (the first N mod P chunks
have one extra element); tree children/span as in tree.py. Only payload bytes count.
"""

from __future__ import annotations

from distrain.comm.core.registry import REGISTRY
from distrain.comm.core.util import chunk_sizes

__all__ = ["chunk_sizes", "traffic"]


def traffic(collective: str, algorithm: str, P: int, rank: int, count: int, elem: int = 4,
            root: int = 0) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` for one call.

    ``count`` is N (elements of the tensor) for broadcast/reduce/all_reduce, and n (elements
    per rank) for scatter/gather/all_gather/reduce_scatter. Barrier: ``count`` is ignored (1 byte).
    Each algorithm's closed form lives beside its schedule (``traffic`` in star.py, ring.py, tree.py).
    """
    if P == 1 or (count == 0 and collective != "barrier"):
        return 0, 0
    if collective == "barrier":
        return traffic("all_reduce", algorithm, P, rank, 1, 1)
    alg = REGISTRY.get(algorithm)
    if alg is None:
        raise ValueError(f"traffic: no model for {collective!r} with algorithm {algorithm!r}")
    s, r = alg.traffic(collective, P, rank, count, root)
    return s * elem, r * elem
