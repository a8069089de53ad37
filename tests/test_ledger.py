"""The traffic ledger equals the documented byte counts exactly.

Two independent checks: the seeds' formulas for all-reduce written out here by hand, and
the closed forms of distrain.comm.algorithms.cost for every collective, algorithm, rank and root.
"""

from __future__ import annotations

import math

import pytest
import torch

import distrain
from distrain import comm
from distrain.comm.algorithms import cost

COLLS = ["broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter", "barrier"]
COUNTS = [60, 7]  # 60 is divisible by 2, 3, 4, 5; 7 is not


def _call(coll: str, alg: str, count: int, root: int, P: int, rank: int) -> None:
    x = torch.ones(count)
    if coll == "broadcast":
        comm.broadcast(x, root, algorithm=alg)
    elif coll == "reduce":
        comm.reduce(x, root, algorithm=alg)
    elif coll == "all_reduce":
        comm.all_reduce(x, algorithm=alg)
    elif coll == "scatter":
        comm.scatter(x, [torch.ones(count) for _ in range(P)] if rank == root else None, root, algorithm=alg)
    elif coll == "gather":
        comm.gather(x, [torch.ones(count) for _ in range(P)] if rank == root else None, root, algorithm=alg)
    elif coll == "all_gather":
        comm.all_gather([torch.ones(count) for _ in range(P)], x, algorithm=alg)
    elif coll == "reduce_scatter":
        comm.reduce_scatter(x, [torch.ones(count) for _ in range(P)], algorithm=alg)
    else:
        comm.barrier(algorithm=alg)


def _measure(rank: int) -> dict:
    import torch.distributed as dist

    P = dist.get_world_size()
    out = {}
    for alg in ["star", "ring", "tree", "native"]:
        for coll in COLLS:
            for count in COUNTS:
                root = P - 1  # a root other than 0 exercises the rotation
                with comm.ledger() as led:
                    _call(coll, alg, count, root, P, rank)
                c = led.get(coll, alg)
                out[(alg, coll, count)] = (c.bytes_sent, c.bytes_recv, c.calls, c.payload_bytes)
    return out


@pytest.fixture(scope="module", params=[2, 3, 4, 5])
def ledgers(request):
    P = request.param
    return P, distrain.spawn(_measure, P, timeout=120)


@pytest.mark.timeout(180)
def test_ledger_equals_cost_model(ledgers):
    P, res = ledgers
    wrong = []
    for rank, table in enumerate(res):
        for (alg, coll, count), (sent, recv, calls, _) in table.items():
            if calls != 1:
                wrong.append(f"{alg} {coll}: {calls} calls recorded")
            if alg == "native":
                if (sent, recv) != (0, 0):  # native traffic is inside Gloo: not counted as ours
                    wrong.append(f"native {coll} recorded bytes")
                continue
            want = cost.traffic(coll, alg, P, rank, count, elem=4, root=P - 1)
            if (sent, recv) != want:
                wrong.append(f"P={P} rank={rank} {alg} {coll} count={count}: ledger {(sent, recv)} model {want}")
    assert not wrong, "\n".join(wrong[:20])


@pytest.mark.timeout(180)
def test_ledger_equals_seed_formulas_for_all_reduce(ledgers):
    P, res = ledgers
    N = 60 * 4  # bytes
    for rank, table in enumerate(res):
        star = table[("star", "all_reduce", 60)][:2]
        ring = table[("ring", "all_reduce", 60)][:2]
        tree = table[("tree", "all_reduce", 60)][:2]
        # master-worker: T = (P-1)*N at the master, each way; a worker moves N each way
        assert star == (((P - 1) * N,) * 2 if rank == 0 else (N, N))
        # ring: T = 2*(N/P)*(P-1) per rank, each way
        assert ring == (2 * (N // P) * (P - 1),) * 2
        # tree: T = log2(P)*N at the root (rounded up for P not a power of two), each way
        if rank == 0:
            assert tree == (math.ceil(math.log2(P)) * N,) * 2
    # the whole ring moves 2*(P-1)*N bytes; the whole star and tree move the same total
    totals = {alg: sum(t[(alg, "all_reduce", 60)][0] for t in res) for alg in ("star", "ring", "tree")}
    assert totals == {"star": 2 * (P - 1) * N, "ring": 2 * (P - 1) * N, "tree": 2 * (P - 1) * N}


@pytest.mark.timeout(180)
def test_payload_bytes(ledgers):
    P, res = ledgers
    for table in res:
        assert table[("native", "all_reduce", 7)][3] == 28
        assert table[("ring", "all_gather", 7)][3] == 28  # this rank's contribution
        assert table[("ring", "reduce_scatter", 7)][3] == 28 * P  # the full input buffer


def test_cost_model_small_cases():
    # hand-checked numbers for P=4, N=8 floats (32 bytes)
    assert [cost.traffic("all_reduce", "ring", 4, r, 8) for r in range(4)] == [(48, 48)] * 4
    assert cost.traffic("all_reduce", "star", 4, 0, 8) == (96, 96)
    assert cost.traffic("all_reduce", "tree", 4, 0, 8) == (64, 64)  # children 1 and 2
    assert cost.traffic("all_reduce", "tree", 4, 3, 8) == (32, 32)  # a leaf
    assert cost.traffic("broadcast", "ring", 4, 1, 8, root=2) == (0, 32)  # the chain's last rank
    assert cost.chunk_sizes(7, 3) == [3, 2, 2]
