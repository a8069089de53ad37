"""Every collective x every algorithm x world sizes 1..5 x dtypes x ops, against a ground truth.

Each rank builds every rank's input from a seeded generator, so it can compute the exact
expected result locally (in float64) and compare. Inputs are small integers, so sums,
products, minima and maxima are exact in every dtype (bfloat16 included): results must be
*equal*, not close, and equal to torch.distributed's native result too.

One spawn per world size runs the whole matrix and returns the list of mismatches.
"""

from __future__ import annotations

import pytest
import torch

from distrain import comm
from distrain.errors import ConfigError

from conftest import run_ranks

ALGS = list(comm.ALGORITHM_NAMES)  # "native" + every registered algorithm
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64]
OPS = ["sum", "prod", "min", "max", "avg"]
SHAPES = [(0,), (1,), (7,), (3, 5)]  # empty, single, not divisible by P, 2-D


def _input(rank: int, case: int, shape, dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    if op == "prod":  # |product| <= 2**5: exact everywhere
        x = torch.randint(1, 3, shape, generator=g) * (1 - 2 * torch.randint(0, 2, shape, generator=g))
    else:
        x = torch.randint(-8, 9, shape, generator=g)
    return x.to(dtype)


def _reduce_ref(xs: list[torch.Tensor], op: str, dtype) -> torch.Tensor:
    s = torch.stack([x.double() for x in xs])
    ref = {"sum": s.sum(0), "avg": s.sum(0) / len(xs), "prod": s.prod(0),
           "min": s.min(0).values if s.numel() else s.sum(0),
           "max": s.max(0).values if s.numel() else s.sum(0)}[op]
    return ref.to(dtype)


def _same(got: torch.Tensor, ref: torch.Tensor, op: str) -> bool:
    if got.shape != ref.shape or got.dtype != ref.dtype:
        return False
    if op == "avg" and got.dtype == torch.bfloat16:  # sum exact, one division: allow 1 ulp
        return torch.allclose(got.double(), ref.double(), rtol=2 ** -7, atol=0)
    return torch.equal(got, ref)


def _matrix(rank: int, transport: str = "torch") -> list[str]:
    import torch.distributed as dist

    comm.set_transport(transport)  # "native" is then Gloo (torch) or the direct shm collectives
    P = dist.get_world_size()
    bad: list[str] = []
    case = 0

    def check(label, got, ref, op=""):
        if not _same(got, ref, op):
            bad.append(f"P={P} rank={rank} {label}: got {got.flatten()[:6].tolist()} want {ref.flatten()[:6].tolist()}")

    for dtype in DTYPES:
        for shape in SHAPES:
            # -- reductions: all_reduce, reduce, reduce_scatter ---------------------------------
            for op in OPS:
                case += 1
                valid = not (op == "avg" and not dtype.is_floating_point)
                xs = [_input(r, case, shape, dtype, op) for r in range(P)]
                for alg in ALGS:
                    label = f"{alg} {dtype} {shape} {op}"
                    root = case % P
                    t = xs[rank].clone()
                    if not valid:
                        try:
                            comm.all_reduce(t, op=op, algorithm=alg)
                            bad.append(f"{label}: all_reduce accepted avg on an integer dtype")
                        except ConfigError:
                            pass
                        continue
                    comm.all_reduce(t, op=op, algorithm=alg)
                    check("all_reduce " + label, t, _reduce_ref(xs, op, dtype), op)
                    t = xs[rank].clone()
                    comm.reduce(t, dst=root, op=op, algorithm=alg)
                    if rank == root:
                        check("reduce " + label, t, _reduce_ref(xs, op, dtype), op)
                    elif alg != "native" and not torch.equal(t, xs[rank]):
                        bad.append(f"reduce {label}: non-root input modified")
                    # reduce_scatter: rank r's list item i is xs-derived, distinct per i
                    ins = [[_input(r, case * 10 + i, shape, dtype, op) for i in range(P)] for r in range(P)]
                    out = torch.full(shape, 99).to(dtype)
                    comm.reduce_scatter(out, [x.clone() for x in ins[rank]], op=op, algorithm=alg)
                    check("reduce_scatter " + label, out, _reduce_ref([ins[r][rank] for r in range(P)], op, dtype), op)
            # -- data movement: broadcast, scatter, gather, all_gather -------------------------
            case += 1
            xs = [_input(r, case, shape, dtype, "sum") for r in range(P)]
            for alg in ALGS:
                label = f"{alg} {dtype} {shape}"
                root = case % P
                t = xs[rank].clone()
                comm.broadcast(t, src=root, algorithm=alg)
                check("broadcast " + label, t, xs[root])
                out = torch.zeros(shape).to(dtype)
                comm.scatter(out, [x.clone() for x in xs] if rank == root else None, src=root, algorithm=alg)
                check("scatter " + label, out, xs[rank])
                lst = [torch.zeros(shape).to(dtype) for _ in range(P)] if rank == root else None
                comm.gather(xs[rank].clone(), lst, dst=root, algorithm=alg)
                if rank == root:
                    for i in range(P):
                        check(f"gather[{i}] " + label, lst[i], xs[i])
                lst = [torch.zeros(shape).to(dtype) for _ in range(P)]
                comm.all_gather(lst, xs[rank].clone(), algorithm=alg)
                for i in range(P):
                    check(f"all_gather[{i}] " + label, lst[i], xs[i])
            for alg in ALGS:
                comm.barrier(algorithm=alg)
    return bad


@pytest.mark.timeout(300)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_every_collective_every_algorithm(P, transport):
    run_ranks(_matrix, P, transport, timeout=240)  # (names the first 40 mismatches and how many)


def _non_contiguous_and_bool(rank: int, transport: str = "torch") -> list[str]:
    import torch.distributed as dist

    comm.set_default_transport(transport)  # the world and the subgroups

    P = dist.get_world_size()
    bad = []
    for alg in ALGS:
        base = torch.arange(12, dtype=torch.float64).view(3, 4) + rank
        t = base.t()  # non-contiguous view: the result must land in the caller's storage
        comm.all_reduce(t, algorithm=alg)
        want = (torch.arange(12, dtype=torch.float64).view(3, 4) * P + sum(range(P))).t()
        if not torch.equal(t, want) or not torch.equal(base.t(), want):
            bad.append(f"{alg}: non-contiguous all_reduce wrong")
        b = torch.tensor([rank == 0, rank == 1, True])
        comm.all_reduce(b, op="max", algorithm=alg)  # logical any
        if b.tolist() != [True, P > 1, True]:
            bad.append(f"{alg}: bool max gave {b.tolist()}")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_non_contiguous_and_bool(transport):
    run_ranks(_non_contiguous_and_bool, 3, transport, timeout=90)


def _async_many_in_flight(rank: int, transport: str = "torch") -> list[str]:
    import torch.distributed as dist

    comm.set_default_transport(transport)  # the world and the subgroups

    P = dist.get_world_size()
    bad = []
    for alg in ALGS:
        ts = [torch.full((1000 + i,), float(rank + i)) for i in range(4)]
        handles = [comm.all_reduce(t, algorithm=alg, async_op=True) for t in ts]
        # a synchronous collective while the async ones may still be in flight
        s = torch.full((5,), float(rank))
        comm.broadcast(s, src=P - 1, algorithm=alg)
        for h in handles:
            h.wait()
            if not h.is_completed():
                bad.append(f"{alg}: is_completed() False after wait()")
        for i, t in enumerate(ts):
            want = float(sum(range(P)) + P * i)
            if not torch.all(t == want):
                bad.append(f"{alg}: async all_reduce #{i} gave {t[0].item()} want {want}")
        if not torch.all(s == P - 1):
            bad.append(f"{alg}: broadcast during async ops gave {s.tolist()}")
        lst = [torch.zeros(3) for _ in range(P)]
        h = comm.all_gather(lst, torch.full((3,), float(rank)), algorithm=alg, async_op=True)
        h.wait()
        if [x[0].item() for x in lst] != [float(r) for r in range(P)]:
            bad.append(f"{alg}: async all_gather wrong")
        comm.barrier(algorithm=alg, async_op=True).wait()
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_async_collectives(P, transport):
    run_ranks(_async_many_in_flight, P, transport, timeout=90)


def _subgroups(rank: int, transport: str = "torch") -> list[str]:
    import torch.distributed as dist

    comm.set_default_transport(transport)  # the world and the subgroups

    bad = []
    evens = dist.new_group([0, 2, 4])
    odds = dist.new_group([1, 3])
    mine, members = (evens, [0, 2, 4]) if rank % 2 == 0 else (odds, [1, 3])
    for alg in ALGS:
        t = torch.full((5,), float(rank))
        comm.all_reduce(t, group=mine, algorithm=alg)
        if not torch.all(t == sum(members)):
            bad.append(f"{alg}: subgroup all_reduce gave {t[0].item()} want {sum(members)}")
        b = torch.full((3,), float(rank))
        comm.broadcast(b, src=members[-1], group=mine, algorithm=alg)  # src is a *global* rank
        if not torch.all(b == members[-1]):
            bad.append(f"{alg}: subgroup broadcast from global rank {members[-1]} gave {b[0].item()}")
        lst = [torch.zeros(2) for _ in members]
        comm.all_gather(lst, torch.full((2,), float(rank)), group=mine, algorithm=alg)
        if [x[0].item() for x in lst] != [float(m) for m in members]:
            bad.append(f"{alg}: subgroup all_gather gave {[x[0].item() for x in lst]}")
    other = odds if rank % 2 == 0 else evens
    # As in torch.distributed: a non-member's call is a no-op that warns (see test_torch_parity)
    x = torch.ones(1)
    with pytest.warns(UserWarning, match="not a member"):
        r = comm.all_reduce(x, group=other, algorithm="ring")
    if r is not None or x.item() != 1.0:
        bad.append("calling a collective on a group this rank is not in was not a no-op")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["torch", "shm"])
def test_subgroups(transport):
    run_ranks(_subgroups, 5, transport, timeout=90)


class _Wire:
    """In-process point-to-point for the ring's own code: P threads, one FIFO per (src, dst) pair,
    a message delivered to the receives of its pair in posting order (Gloo's matching). Records every
    post as (rank, "send" | "recv", peer, elements)."""

    def __init__(self, P: int):
        import queue
        import threading

        self.P, self.log, self.lock = P, [], threading.Lock()
        self.fifo = {(s, d): queue.Queue() for s in range(P) for d in range(P) if s != d}
        self.posted = {k: [] for k in self.fifo}
        self.delivered = {k: 0 for k in self.fifo}

    def comm(self, rank: int):
        wire = self

        class Done:
            def wait(self, timeout=None):
                return True

        class Recv:
            def __init__(self, key, k):
                self.key, self.k = key, k

            def wait(self, timeout=None):
                while wire.delivered[self.key] <= self.k:  # deliver in posting order up to this receive
                    msg = wire.fifo[self.key].get(timeout=30)
                    buf = wire.posted[self.key][wire.delivered[self.key]]
                    assert msg.numel() == buf.numel(), "a message matched a receive of another size"
                    buf.copy_(msg)
                    wire.delivered[self.key] += 1
                return True

        class PC:
            size = wire.P

            def isend(self, t, peer):
                with wire.lock:
                    wire.log.append((rank, "send", peer, t.numel()))
                wire.fifo[(rank, peer)].put(t.clone())
                return Done()

            def irecv(self, t, peer):
                with wire.lock:
                    wire.log.append((rank, "recv", peer, t.numel()))
                key = (peer, rank)
                wire.posted[key].append(t)
                return Recv(key, len(wire.posted[key]) - 1)

        pc = PC()
        pc.rank = rank
        return pc


@pytest.mark.timeout(60)
@pytest.mark.parametrize("P", [2, 3, 4])
def test_ring_all_reduce_posts_the_all_gather_receives_before_its_first_send(P):
    """Gloo sends a message only once the receiver's "receive ready" notice has arrived, so the ring's
    all_reduce posts both phases' receives before its first send (docs/cost_model.md, "Latency"); the
    result stays exact with chunks of two pieces (about 1.5 MiB each, 2 more elements than P chunks)."""
    import threading

    from distrain.comm.algorithms import ring
    from distrain.comm.core.ops import resolve_op

    n = P * (3 << 17) + 2  # float32: chunks of 393217, 393217, then 393216 elements: 2 pieces each
    wire = _Wire(P)
    xs = [torch.randint(-8, 9, (n,), generator=torch.Generator().manual_seed(r)).float() for r in range(P)]
    bufs = [x.clone() for x in xs]
    op = resolve_op("sum", torch.float32, "all_reduce")
    errors = []

    def rank_main(r):
        try:
            ring.all_reduce(wire.comm(r), bufs[r], op)
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append((r, e))

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    ref = torch.stack(xs).sum(0)
    for r in range(P):
        assert torch.equal(bufs[r], ref), r
    chunks = [393217] * 2 + [393216] * (P - 2)
    for r in range(P):
        mine = [(kind, peer, k) for rank, kind, peer, k in wire.log if rank == r]
        first_send = next(i for i, e in enumerate(mine) if e[0] == "send")
        # reduce-scatter step s receives chunk r-s-2, all-gather step s chunk r-s-1, each in 2 pieces
        rs = [c for s in range(P - 1) for c in torch.tensor_split(torch.empty(chunks[(r - s - 2) % P]), 2)]
        ag = [c for s in range(P - 1) for c in torch.tensor_split(torch.empty(chunks[(r - s - 1) % P]), 2)]
        assert mine[:first_send] == [("recv", (r - 1) % P, c.numel()) for c in rs + ag], r
        assert sum(1 for e in mine if e[0] == "recv") == len(rs) + len(ag)
