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

from distrain.comm import tree as _tree


def chunk_sizes(N: int, P: int) -> list[int]:
    q, rem = divmod(N, P)
    return [q + 1 if i < rem else q for i in range(P)]


def _tree_kids(v: int, P: int) -> int:
    return len(_tree._children(v, P))


def traffic(collective: str, algorithm: str, P: int, rank: int, count: int, elem: int = 4,
            root: int = 0) -> tuple[int, int]:
    """(bytes sent, bytes received) by ``rank`` for one call.

    ``count`` is N (elements of the tensor) for broadcast/reduce/all_reduce, and n (elements
    per rank) for scatter/gather/all_gather/reduce_scatter. Barrier: ``count`` is ignored (1 byte).
    """
    if P == 1 or (count == 0 and collective != "barrier"):
        return 0, 0
    if collective == "barrier":
        return traffic("all_reduce", algorithm, P, rank, 1, 1)
    star_root = 0 if collective in ("all_reduce", "all_gather", "reduce_scatter") else root
    v = (rank - (star_root if algorithm in ("star", "tree") else root)) % P
    N = n = count
    s, r = _elements(collective, algorithm, P, rank, v, N, n, root)
    return s * elem, r * elem


def _elements(coll: str, alg: str, P: int, rank: int, v: int, N: int, n: int, root: int) -> tuple[int, int]:
    c = chunk_sizes(N, P)
    span = _tree._span(v, P)
    kids = _tree_kids(v, P)
    nonroot = 1 if v else 0
    if alg == "star":
        table = {
            "broadcast": ((P - 1) * N, 0) if v == 0 else (0, N),
            "reduce": (0, (P - 1) * N) if v == 0 else (N, 0),
            "all_reduce": ((P - 1) * N, (P - 1) * N) if v == 0 else (N, N),
            "scatter": ((P - 1) * n, 0) if v == 0 else (0, n),
            "gather": (0, (P - 1) * n) if v == 0 else (n, 0),
            "all_gather": ((P - 1) * P * n, (P - 1) * n) if v == 0 else (n, P * n),
            "reduce_scatter": ((P - 1) * n, (P - 1) * P * n) if v == 0 else (P * n, n),
        }
        return table[coll]
    if alg == "ring":
        r = rank
        if coll == "all_reduce":
            return (N - c[r]) + (N - c[(r + 1) % P]), (N - c[(r - 1) % P]) + (N - c[r])
        if coll in ("all_gather", "reduce_scatter"):
            return (P - 1) * n, (P - 1) * n
        if coll == "broadcast":
            return (N if v < P - 1 else 0), (N if v > 0 else 0)
        if coll == "reduce":
            rs_sent, rs_recv = N - c[r], N - c[(r - 1) % P]
            if v == 0:
                return rs_sent, rs_recv + (N - c[r])
            return rs_sent + c[r], rs_recv
        if coll == "scatter":
            return ((P - 1) * n, 0) if v == 0 else ((P - v - 1) * n, (P - v) * n)
        if coll == "gather":
            return (0, (P - 1) * n) if v == 0 else ((P - v) * n, (P - v - 1) * n)
    if alg == "tree":
        if coll == "all_reduce":
            return N * (kids + nonroot), N * (kids + nonroot)
        if coll == "broadcast":
            return N * kids, N * nonroot
        if coll == "reduce":
            return N * nonroot, N * kids
        if coll == "scatter":
            return (span - 1) * n, span * n * nonroot
        if coll == "gather":
            return span * n * nonroot, (span - 1) * n
        if coll == "all_gather":  # gather to 0, then broadcast of the P*n buffer
            return span * n * nonroot + P * n * kids, (span - 1) * n + P * n * nonroot
        if coll == "reduce_scatter":  # reduce of the P*n buffer to 0, then scatter
            return P * n * nonroot + (span - 1) * n, P * n * kids + span * n * nonroot
    raise ValueError(f"traffic: no model for {coll!r} with algorithm {alg!r}")
