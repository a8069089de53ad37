"""Message schedules of distrain's algorithms, message by message, for the simulator.

Each builder writes down what the code in ``distrain.comm.{star,ring,tree}`` and
``distrain.parallel.parameter_server`` sends: who sends how many bytes to whom, after which
arrivals, and after how much reduction work (γ per byte added). Messages are created in the
order a rank posts them, so one pair's messages keep Gloo's per-connection order.

Notation: P ranks; N elements of ``elem`` bytes (all_reduce, broadcast, reduce); n elements
per rank (all_gather, reduce_scatter); roots are rank 0 (the benchmark's and the composed
collectives' root). Schedules, as in the code:

* star: workers -> root (reduce), root -> workers (broadcast); the root posts all its
  receives/sends at once, so they share its downlink/uplink; it adds P-1 contributions;
* ring: chunks ``tensor_split(N, P)``, each cut into ``min(16, ceil(bytes/1 MiB))`` pieces;
  reduce-scatter step s sends chunk (r-s-1) to r+1, a piece forwarded once received and
  added; all-gather step s sends chunk (r-s); 2(P-1) steps (Patarasuk & Yuan 2009);
* tree: MPICH's binomial tree; a node sends to its parent once every child's message
  arrived and was added; the root sends down to its children, largest subtree first;
* parameter server (sync, S shards on the last S ranks, W = P - S workers): every server
  sends its shard N_s to every worker (pull), every worker sends N_s of gradient to every
  server once it has all shards (push), the server adds W gradients and steps.
"""

from __future__ import annotations

from distrain.comm.algorithms import tree as binomial  # (its parent/children rule; tree() below is the schedule)
from distrain.comm.algorithms.cost import chunk_sizes
from distrain.costmodel.sim import Message

PIECE_BYTES, MAX_PIECES = 1 << 20, 16  # as distrain.comm.algorithms.ring


class _Sched:
    def __init__(self) -> None:
        self.msgs: list[Message] = []

    def add(self, src: int, dst: int, nbytes: float, deps=(), delay: float = 0.0) -> int:
        self.msgs.append(Message(src, dst, nbytes, tuple(deps), delay))
        return len(self.msgs) - 1


def _pieces(nbytes: int, elem: int) -> list[int]:
    n = nbytes // elem
    k = min(MAX_PIECES, max(1, -(-nbytes // PIECE_BYTES)))
    return [c * elem for c in chunk_sizes(n, k)]


def _ring_rs(sc: _Sched, P: int, chunk_bytes: list[int], elem: int, gamma: float) -> dict:
    rs: dict[tuple[int, int, int], int] = {}
    for s in range(P - 1):
        for r in range(P):
            for j, b in enumerate(_pieces(chunk_bytes[(r - s - 1) % P], elem)):
                deps = () if s == 0 else (rs[((r - 1) % P, s - 1, j)],)
                rs[(r, s, j)] = sc.add(r, (r + 1) % P, b, deps, 0.0 if s == 0 else gamma * b)
    return rs


def _ring_ag(sc: _Sched, P: int, chunk_bytes: list[int], elem: int, gamma: float, rs: dict | None) -> None:
    ag: dict[tuple[int, int, int], int] = {}
    for s in range(P - 1):
        for r in range(P):
            for j, b in enumerate(_pieces(chunk_bytes[(r - s) % P], elem)):
                if s > 0:
                    deps, delay = (ag[((r - 1) % P, s - 1, j)],), 0.0
                elif rs is not None:  # chunk r became final at the last reduce-scatter step
                    deps, delay = (rs[((r - 1) % P, P - 2, j)],), gamma * b
                else:
                    deps, delay = (), 0.0
                ag[(r, s, j)] = sc.add(r, (r + 1) % P, b, deps, delay)


def ring(collective: str, P: int, count: int, elem: int, gamma: float) -> tuple[list[Message], float] | None:
    sc = _Sched()
    if collective == "all_reduce":
        cb = [c * elem for c in chunk_sizes(count, P)]
        _ring_ag(sc, P, cb, elem, gamma, _ring_rs(sc, P, cb, elem, gamma))
        return sc.msgs, 0.0
    if collective == "reduce_scatter":
        cb = [count * elem] * P
        _ring_rs(sc, P, cb, elem, gamma)
        return sc.msgs, gamma * max(_pieces(count * elem, elem))
    if collective == "all_gather":
        _ring_ag(sc, P, [count * elem] * P, elem, gamma, None)
        return sc.msgs, 0.0
    return None


def star(collective: str, P: int, count: int, elem: int, gamma: float) -> tuple[list[Message], float] | None:
    sc = _Sched()
    others = range(1, P)
    if collective in ("reduce", "all_reduce", "reduce_scatter"):
        full = count * elem * (P if collective == "reduce_scatter" else 1)
        up = [sc.add(p, 0, full) for p in others]
        add = (P - 1) * gamma * full
        if collective == "reduce":
            return sc.msgs, add
        per = full if collective == "all_reduce" else count * elem
        for p in others:
            sc.add(0, p, per, up, add)
        return sc.msgs, 0.0
    if collective == "broadcast":
        for p in others:
            sc.add(0, p, count * elem)
        return sc.msgs, 0.0
    if collective == "all_gather":
        up = [sc.add(p, 0, count * elem) for p in others]
        for p in others:
            sc.add(0, p, P * count * elem, up)
        return sc.msgs, 0.0
    return None


def _tree_reduce(sc: _Sched, P: int, nbytes: int, gamma: float) -> tuple[list[int], float]:
    """Messages up the tree; returns the ids arriving at the root and the root's add time."""
    sent: dict[int, int] = {}
    for v in range(P - 1, 0, -1):  # children (larger positions) before parents
        kids = binomial.children(v, P)
        sent[v] = sc.add(v, v - binomial.lowbit(v), nbytes, [sent[c] for c in kids], gamma * nbytes * len(kids))
    root_kids = binomial.children(0, P)
    return [sent[c] for c in root_kids], gamma * nbytes * len(root_kids)


def _tree_bcast(sc: _Sched, P: int, nbytes: int, root_deps=(), root_delay: float = 0.0) -> None:
    got: dict[int, int] = {}
    for v in range(P):
        deps, delay = (root_deps, root_delay) if v == 0 else ((got[v],), 0.0)
        for c in reversed(binomial.children(v, P)):
            got[c] = sc.add(v, c, nbytes, deps, delay)


def tree(collective: str, P: int, count: int, elem: int, gamma: float) -> tuple[list[Message], float] | None:
    sc = _Sched()
    nbytes = count * elem
    if collective == "reduce":
        _, add = _tree_reduce(sc, P, nbytes, gamma)
        return sc.msgs, add
    if collective == "broadcast":
        _tree_bcast(sc, P, nbytes)
        return sc.msgs, 0.0
    if collective == "all_reduce":
        ids, add = _tree_reduce(sc, P, nbytes, gamma)
        _tree_bcast(sc, P, nbytes, ids, add)
        return sc.msgs, 0.0
    return None


def parameter_server(P: int, servers: int, nbytes: int, gamma: float,
                     update_s: float | None = None) -> tuple[list[Message], float]:
    """One synchronous PS round (pull + push) of a model of ``nbytes``, balanced over the shards.

    The tail is the server's work after the last push arrives: adding W gradients (γ per
    byte each) and the optimizer step, ``update_s`` seconds per shard (default: one more
    pass, γ·N_s, as plain SGD)."""
    W = P - servers
    if W < 1 or servers < 1:
        raise ValueError(f"parameter server: need at least one worker and one server, got P={P}, S={servers}")
    shard = nbytes / servers
    sc = _Sched()
    pulls: dict[int, list[int]] = {w: [] for w in range(W)}
    for s in range(servers):
        for w in range(W):
            pulls[w].append(sc.add(W + s, w, shard))
    for w in range(W):
        for s in range(servers):
            sc.add(w, W + s, shard, pulls[w])
    # each server adds W gradients and takes an optimizer step
    return sc.msgs, gamma * shard * W + (gamma * shard if update_s is None else update_s)


BUILDERS = {"star": star, "ring": ring, "tree": tree}
