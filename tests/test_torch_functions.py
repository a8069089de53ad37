"""The torch.distributed functions distrain.comm adds (issue 10), on every algorithm, against torch's own.

Each rank computes torch.distributed's native result for the same inputs and compares exactly;
world size 3 (odd) and block sizes that do not divide evenly.
"""

from __future__ import annotations

import pytest
import torch

import distrain
import distrain.comm as dist  # the point: it reads like torch.distributed
from distrain.errors import CommError, ConfigError

from conftest import run_ranks

ALGS = ["native", "star", "ring", "tree"]


def _x(rank: int, n: int, salt: int = 0, dtype=torch.float64) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float64) * (rank + 1) + 10 * rank + salt).to(dtype)


def _tensor_forms(rank: int) -> list[str]:
    import torch.distributed as tdist

    P = dist.get_world_size()
    bad = []
    for alg in ALGS:
        # all_gather_into_tensor: concatenated (P*3, 2) and stacked (P, 3, 2) outputs
        inp = _x(rank, 6).view(3, 2)
        ref = torch.empty(P * 3, 2, dtype=torch.float64)
        tdist.all_gather_into_tensor(ref, inp)
        for shape in ((P * 3, 2), (P, 3, 2)):
            out = torch.zeros(shape, dtype=torch.float64)
            dist.all_gather_into_tensor(out, inp, algorithm=alg)
            if not torch.equal(out.view(-1), ref.view(-1)):
                bad.append(f"{alg}: all_gather_into_tensor {shape}")
        # reduce_scatter_tensor
        big = _x(rank, P * 4).view(P * 2, 2)
        ref = torch.empty(2, 2, dtype=torch.float64)
        tdist.reduce_scatter_tensor(ref, big.clone())
        out = torch.zeros(2, 2, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, big, op=dist.ReduceOp.SUM, algorithm=alg)
        if not torch.equal(out, ref):
            bad.append(f"{alg}: reduce_scatter_tensor {out.tolist()} want {ref.tolist()}")
        # coalesced: sync and async
        for async_op in (False, True):
            ts = [_x(rank, 5), _x(rank, 3, 1).view(3, 1), _x(rank, 0)]
            refs = [t.clone() for t in ts]
            for t in refs:
                tdist.all_reduce(t)
            h = dist.all_reduce_coalesced(ts, group=None, async_op=async_op, algorithm=alg)
            if async_op:
                h.wait()
            if not all(torch.equal(a, b) for a, b in zip(ts, refs)):
                bad.append(f"{alg}: all_reduce_coalesced async={async_op}")
        ins = [_x(rank, 4), _x(rank, 2, 5)]
        outs = [[torch.zeros(4, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)] for _ in range(P)]
        dist.all_gather_coalesced(outs, ins, algorithm=alg)
        if not all(torch.equal(outs[r][0], _x(r, 4)) and torch.equal(outs[r][1], _x(r, 2, 5)) for r in range(P)):
            bad.append(f"{alg}: all_gather_coalesced")
    return bad


def _alltoall(rank: int) -> list[str]:
    import torch.distributed as tdist

    P = dist.get_world_size()
    bad = []
    # uneven rows: rank i sends (i + j) % 3 + 1 rows of width 2 to rank j (some pairs 1 row, some 3)
    ins_rows = [(rank + j) % 3 + 1 for j in range(P)]
    outs_rows = [(i + rank) % 3 + 1 for i in range(P)]
    inp = _x(rank, 2 * sum(ins_rows)).view(-1, 2)
    ref = torch.empty(sum(outs_rows), 2, dtype=torch.float64)
    tdist.all_to_all_single(ref, inp, outs_rows, ins_rows)
    eq_in = _x(rank, P * 4, dtype=torch.float32)
    eq_ref = torch.empty(P * 4, dtype=torch.float32)
    tdist.all_to_all_single(eq_ref, eq_in)
    for alg in (*ALGS, "p2p"):  # p2p: the direct exchange (the all-to-alls only)
        out = torch.zeros_like(ref)
        dist.all_to_all_single(out, inp, outs_rows, ins_rows, algorithm=alg)
        if not torch.equal(out, ref):
            bad.append(f"{alg}: all_to_all_single uneven")
        out = torch.zeros_like(eq_ref)
        with dist.ledger() as led:
            h = dist.all_to_all_single(out, eq_in, algorithm=alg, async_op=True)
            h.wait()
        if not torch.equal(out, eq_ref):
            bad.append(f"{alg}: all_to_all_single equal (async)")
        if alg == "star":  # sizes: all_gather of 2P int64; data: gather + scatter of P*m float32 via rank 0
            want = (P - 1) * 2 * P * P * 8 + (P - 1) * P * 4 * 4 if rank == 0 else 2 * P * 8 + P * 4 * 4
            if led.bytes_sent("all_to_all", "star") != want:
                bad.append(f"star all_to_all sent {led.bytes_sent('all_to_all', 'star')} bytes, want {want}")
        if alg == "p2p":  # one message of 4 float32 to each other rank, one call, nothing else
            c = led.get("all_to_all", "p2p")
            got = (c.calls, c.bytes_sent, c.bytes_recv, c.msgs_sent, c.msgs_recv, led.total().calls)
            if got != (1, (P - 1) * 16, (P - 1) * 16, P - 1, P - 1, 1):
                bad.append(f"p2p all_to_all ledger (calls, sent, recv, msgs sent, msgs recv, all calls) {got}")
        lst_in = [_x(rank, j + 1, 7) for j in range(P)]  # rank sends j+1 elements to rank j
        lst_out = [torch.zeros(rank + 1, dtype=torch.float64) for _ in range(P)]
        dist.all_to_all(lst_out, lst_in, algorithm=alg)
        if not all(torch.equal(lst_out[i], _x(i, rank + 1, 7)) for i in range(P)):
            bad.append(f"{alg}: all_to_all lists")
    # p2p: label= names the call in the ledger; the debug fingerprint knows the algorithm by name
    out = torch.zeros_like(ref)
    with dist.ledger() as led:
        dist.all_to_all_single(out, inp, outs_rows, ins_rows, algorithm="p2p", label="mine")
    if not torch.equal(out, ref) or (led.get("mine", "p2p").calls, led.get("all_to_all", "p2p").calls) != (1, 0):
        bad.append(f"p2p with label: {led.as_dict()}")
    dist.set_debug(True)
    try:
        dist.all_to_all_single(out, inp, outs_rows, ins_rows, algorithm="p2p")  # all alike: passes
        dist.all_to_all_single(torch.zeros_like(eq_ref), eq_in, algorithm="star" if rank == 2 else "p2p")
        bad.append("debug: p2p here and star on rank 2 was not refused")
    except CommError as e:
        if "all_to_all(algorithm=p2p)" not in str(e) or "all_to_all(algorithm=star)" not in str(e):
            bad.append(f"debug: the fingerprint does not name both algorithms: {e}")
    finally:
        dist.set_debug(False)
    if not torch.equal(out, ref):
        bad.append("p2p under debug checks")
    try:
        dist.all_to_all_single(out, inp, algorithm="bogus")
        bad.append("an unknown algorithm was taken")
    except ConfigError as e:
        if "p2p" not in str(e):
            bad.append(f"the unknown-algorithm error does not offer p2p: {e}")
    return bad


def _objects_and_p2p(rank: int) -> list[str]:
    P = dist.get_world_size()
    bad = []
    objs = [{"rank": r, "pad": "x" * (r * 37)} for r in range(P)]
    for alg in ALGS:
        got = [None] * P
        dist.all_gather_object(got, objs[rank], algorithm=alg)
        if got != objs:
            bad.append(f"{alg}: all_gather_object {got}")
        lst = [None] * P if rank == 1 else None
        dist.gather_object(objs[rank], lst, dst=1, algorithm=alg)
        if rank == 1 and lst != objs:
            bad.append(f"{alg}: gather_object {lst}")
        b = ["a", {"b": rank}, None] if rank == 2 else [None, None, None]
        dist.broadcast_object_list(b, src=2, algorithm=alg)
        if b != ["a", {"b": 2}, None]:
            bad.append(f"{alg}: broadcast_object_list {b}")
        out = [None]
        dist.scatter_object_list(out, [("for", r, "y" * r) for r in range(P)] if rank == 0 else None, src=0,
                                 algorithm=alg)
        if out != [("for", rank, "y" * rank)]:
            bad.append(f"{alg}: scatter_object_list {out}")
    if rank == 0:
        got = [None, None]
        sender = dist.recv_object_list(got)  # any source
        if sender != 2 or got != [[1, 2], "from 2"]:
            bad.append(f"recv_object_list: {sender} {got}")
    elif rank == 2:
        dist.send_object_list([[1, 2], "from 2"], dst=0)
    # a ring exchange with batch_isend_irecv
    nxt, prv = (rank + 1) % P, (rank - 1) % P
    recv_buf = torch.zeros(3)
    ops = [dist.P2POp(dist.isend, torch.full((3,), float(rank)), nxt),
           dist.P2POp(dist.irecv, recv_buf, prv)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    if not torch.equal(recv_buf, torch.full((3,), float(prv))):
        bad.append(f"batch_isend_irecv got {recv_buf.tolist()}")
    dist.monitored_barrier(timeout=__import__("datetime").timedelta(seconds=60))
    return bad


def _own_group(rank: int) -> list:
    dist.init_process_group("gloo")
    g = dist.new_group([0, 2])
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=g, algorithm="ring")  # rank 1: a no-op with a warning
    ranks = dist.get_process_group_ranks(g) if rank != 1 else None
    backend = dist.get_backend()
    dist.destroy_process_group()
    return [t[0].item(), ranks, backend, dist.is_initialized()]


@pytest.mark.timeout(300)
def test_tensor_and_coalesced_forms_equal_torch():
    run_ranks(_tensor_forms, 3, timeout=250)


@pytest.mark.timeout(300)
def test_all_to_all_equals_torch_with_uneven_splits():
    run_ranks(_alltoall, 3, timeout=250)


@pytest.mark.timeout(300)
def test_object_collectives_and_batch_p2p():
    run_ranks(_objects_and_p2p, 3, timeout=250)


@pytest.mark.timeout(120)
def test_group_helpers_through_distrain_comm():
    out = distrain.spawn(_own_group, 3, init=False, timeout=90)
    assert out == [[2.0, [0, 2], "gloo", False], [1.0, None, "gloo", False], [2.0, [0, 2], "gloo", False]]
