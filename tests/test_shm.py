"""The shared-memory transport: equality with Gloo for every dtype, op and collective
(chunked sizes, odd world sizes, sizes not divisible by P), P2P ordering, the hierarchical
all_reduce with one host made to look like two, selection, and faults (a dead peer, a
peer that never comes, a full /dev/shm, leftovers of a crashed run)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import pytest
import torch

import distrain
from distrain import comm
from distrain.comm.shm import compiled
from distrain.comm.shm import transport as shm
from distrain.comm.shm import segment as shm_segment
from distrain.comm.core.group import fast_path
from distrain.comm.core.ops import SUPPORTED_DTYPES
from distrain.errors import CommError, ConfigError

from conftest import init_raw_rank, raw_ranks, run_ranks, shm_files_of

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory transport needs x86-64 and /dev/shm")

BIG = (1 << 18) + 7  # 1 MiB + 28 bytes of float32: 17 slots of SMALL_SLOT, not divisible by P
SMALL_SLOT = 64 << 10  # tests shrink the slot so that chunking is exercised at modest sizes
# Every equivalence test runs on both data planes: the compiled one (built at install) and its
# Python reference; CI builds the extension, so both run there.
KERNELS = [pytest.param("compiled", marks=pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))),
           "python"]


def _ops(dtype) -> list[str]:
    if dtype == torch.bool:
        return ["max", "min", "band", "bor", "bxor"]
    if dtype.is_floating_point:
        return ["sum", "avg", "prod", "min", "max"]
    return ["sum", "prod", "min", "max", "band", "bor", "bxor"]


def _x(rank: int, case: int, n: int, dtype, op: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * case + rank)
    lo, hi = (1, 3) if op == "prod" else (0, 6)  # small integers: exact in every dtype
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _shm_world_beside_gloo(kernels: str):
    """In a rank: the world group on shared memory (small slots, so messages span several) with
    ``kernels``, and a Gloo group of the same ranks for the reference results. Returns (P, the Gloo group)."""
    import torch.distributed as dist

    P = dist.get_world_size()
    gloo = dist.new_group(list(range(P)))
    shm.SLOT_BYTES = SMALL_SLOT
    comm.set_shm_kernels(kernels)
    comm.set_transport("shm")
    comm.set_transport("torch", gloo)
    return P, gloo


def _vs_gloo(rank: int, sizes: list[int], kernels: str) -> list[str]:
    """Every collective on the shm world group against the same call on a Gloo group."""
    P, gloo = _shm_world_beside_gloo(kernels)
    bad, case = [], 0

    def same(label, a, b):
        b = b.to(a.dtype)  # the Gloo reference ran in a wide dtype (Gloo lacks int16, bool, ...)
        if not torch.equal(a, b):
            bad.append(f"P={P} rank {rank} {label}: shm {a[:4].tolist()} gloo {b[:4].tolist()}")

    for dtype in SUPPORTED_DTYPES:
        wide = torch.float64 if dtype.is_floating_point else torch.uint8 if dtype == torch.bool else torch.int64
        for n in sizes if dtype in (torch.float32, torch.int32) else sizes[:2]:
            for op in _ops(dtype):
                case += 1
                label = f"{dtype} n={n} {op}"
                x = _x(rank, case, n, dtype, op)
                a, b = x.clone(), x.to(wide, copy=True)
                comm.all_reduce(a, op=op)
                comm.all_reduce(b, op=op, group=gloo)
                same("all_reduce " + label, a, b)
                root = case % P
                a, b = x.clone(), x.to(wide, copy=True)
                comm.reduce(a, dst=root, op=op)
                comm.reduce(b, dst=root, op=op, group=gloo)
                same("reduce " + label, a, b if rank == root else x)  # non-root inputs stay intact
                ins = [_x(rank, case * 31 + i, n, dtype, op) for i in range(P)]
                a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=wide)
                comm.reduce_scatter(a, [t.clone() for t in ins], op=op)
                comm.reduce_scatter(b, [t.to(wide, copy=True) for t in ins], op=op, group=gloo)
                same("reduce_scatter " + label, a, b)
                whole = torch.stack(ins)  # one buffer: the direct path reads it in place, and must not write it
                c = torch.empty(n, dtype=dtype)
                comm.reduce_scatter_tensor(c, whole.view(-1), op=op)
                same("reduce_scatter_tensor " + label, c, b)
                same("reduce_scatter_tensor input intact " + label, whole, torch.stack(ins))
            case += 1
            x, root = _x(rank, case, n, dtype, "sum"), case % P
            for g in (None, gloo):
                out = [torch.empty(n, dtype=dtype if g is None else wide) for _ in range(P)]
                comm.all_gather(out, x if g is None else x.to(wide, copy=True), group=g)
                if g is None:
                    mine = out
                else:
                    for i in range(P):
                        same(f"all_gather[{i}] {dtype} n={n}", mine[i], out[i])
            a = x.clone()
            comm.broadcast(a, src=root)
            same(f"broadcast {dtype} n={n}", a, _x(root, case, n, dtype, "sum"))
            lst = [_x(q, case + 5, n, dtype, "sum") for q in range(P)]
            a = torch.empty(n, dtype=dtype)
            comm.scatter(a, lst if rank == root else None, src=root)
            same(f"scatter {dtype} n={n}", a, lst[rank])
            got = [torch.empty(n, dtype=dtype) for _ in range(P)] if rank == root else None
            comm.gather(x, got, dst=root)
            if rank == root:
                for q in range(P):
                    same(f"gather[{q}] {dtype} n={n}", got[q], _x(q, case, n, dtype, "sum"))
    comm.barrier()
    return bad


@pytest.mark.timeout(600)
@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("kernels", KERNELS)
def test_direct_collectives_equal_gloo(P, kernels):
    sizes = [1, 13, BIG] if P != 5 else [1, 13, 4099]
    run_ranks(_vs_gloo, P, sizes, kernels, timeout=540)


def _symmetric(t: torch.Tensor, group=None) -> bool:
    from distrain.comm.core.group import resolve

    heap = getattr(resolve(group, "test").transport, "heap", None)
    return heap is not None and heap.locate(t) is not None


def _list_and_symmetric(rank: int, kernels: str) -> list[str]:
    """all_reduce_list equals all_reduce of the concatenation scaled first, bit for bit, on shm and
    Gloo; all_reduce on symmetric memory (in place in every rank's copy) equals Gloo's, at offsets
    inside an allocation and over several slot-sized chunks; DDP's buckets are symmetric over shm
    (native) and only then; a rank passing an ordinary tensor against symmetric ones is named."""
    import warnings

    import torch.distributed as dist

    from distrain.parallel import DistributedDataParallel

    P, gloo = _shm_world_beside_gloo(kernels)
    bad = []
    for group in (None, gloo):
        for dtype, scale in ((torch.float32, 1.0 / P), (torch.float64, None)):
            g = torch.Generator().manual_seed(rank)
            ts = [torch.randn(*shape, generator=g, dtype=dtype) for shape in ((5,), (20000,), (0,), (777,), (3, 4001))]
            ref = torch.cat([t.reshape(-1) for t in ts])
            if scale is not None:
                ref = ref * scale
            comm.all_reduce(ref, group=group)
            comm.all_reduce_list(ts, scale=scale, group=group, async_op=True).wait()
            if not torch.equal(torch.cat([t.reshape(-1) for t in ts]), ref):
                bad.append(f"P={P} rank {rank} {dtype} group {group}: all_reduce_list differs from the concatenation")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        if comm.has_list_all_reduce(gloo) is not True or not any(x.category is DeprecationWarning for x in w):
            bad.append("has_list_all_reduce: not a deprecated True")

    # symmetric memory: 3 allocations; tensors at offsets; sizes of 0, 1, odd, several chunks
    big = comm.symmetric_empty(2, 3 * SMALL_SLOT + 1001, dtype=torch.float64)
    ints = comm.symmetric_empty(4099, dtype=torch.int64)
    halves = comm.symmetric_empty(777, dtype=torch.float32)
    if not all(_symmetric(t) for t in (big, ints, halves)) or _symmetric(torch.ones(3)):
        bad.append(f"rank {rank}: symmetric_empty did not give symmetric memory on shm")
    if _symmetric(comm.symmetric_empty(5, group=gloo), gloo):
        bad.append("symmetric_empty on a Gloo group must give ordinary memory")
    g = torch.Generator().manual_seed(100 + rank)
    cases = [(big[1], "sum"), (big[0, 7:7 + 3 * 1001], "max"), (big[1, :1], "sum"), (big[0, :0], "sum"),
             (ints, "sum"), (ints[1:], "bxor"), (halves, "avg"), (big.view(-1), "sum")]
    for k, (t, op) in enumerate(cases * 2):  # twice: the second round rewrites what peers wrote
        src = torch.randint(-50, 50, t.shape, generator=g).to(t.dtype)  # integers: exact sums in any order
        t.copy_(src)
        ref = src.clone()
        comm.all_reduce(ref, op=op, group=gloo)
        comm.all_reduce(t, op=op)
        if not torch.equal(t, ref):
            bad.append(f"P={P} rank {rank} case {k}: symmetric all_reduce({op}) of {tuple(t.shape)} {t.dtype} "
                       f"differs from Gloo's")
    model = DistributedDataParallel(torch.nn.Linear(4, 2), algorithm="native")
    if not all(_symmetric(b.buffer) for b in model._buckets) or \
            _symmetric(DistributedDataParallel(torch.nn.Linear(4, 2), algorithm="ring")._buckets[0].buffer):
        bad.append("DDP over shm with algorithm native must keep its buckets in symmetric memory (and only then)")

    # last, on a group of its own (a failed collective aborts its group): rank 0 symmetric, the others not
    odd = dist.new_group(list(range(P)))
    comm.set_transport("shm", odd)
    x = comm.symmetric_empty(10, group=odd)
    try:
        comm.all_reduce(x if rank == 0 else torch.ones(10), group=odd)
        bad.append(f"rank {rank}: a symmetric tensor against ordinary ones was not refused")
    except CommError as e:
        named = ("rank 1 passed an ordinary tensor, this rank symmetric allocation 0 at byte offset 0" if rank == 0
                 else "rank 0 passed symmetric allocation 0 at byte offset 0, this rank an ordinary tensor")
        if named not in str(e):
            bad.append(f"rank {rank}: unclear error for a symmetric/ordinary mix: {e}")
    comm.barrier(group=gloo)
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kernels", KERNELS)
def test_list_and_symmetric_all_reduce_equal_gloo(P, kernels):
    run_ranks(_list_and_symmetric, P, kernels, timeout=150)


def _gather_scatter_symmetric(rank: int, kernels: str) -> list[str]:
    """all_gather into, and reduce_scatter out of, a (P, n) buffer in symmetric memory equal Gloo's
    (the symmetric paths copy straight from the peers' buffers); ordinary buffers still work beside
    them; a rank passing an ordinary output against symmetric ones is named, not answered wrongly."""
    import torch.distributed as dist

    P, gloo = _shm_world_beside_gloo(kernels)
    bad = []
    g = torch.Generator().manual_seed(300 + rank)
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for n in (1, 777, 3 * SMALL_SLOT // 4 + 5):
            x = torch.randint(-50, 50, (n,), generator=g).to(dtype)
            for sym in (True, False):
                out = comm.symmetric_empty(P, n, dtype=dtype) if sym else torch.empty(P, n, dtype=dtype)
                if sym != _symmetric(out):
                    bad.append(f"rank {rank}: symmetric_empty({P}, {n}) symmetric={_symmetric(out)}")
                ref = torch.empty(P, n, dtype=dtype)
                comm.all_gather(list(out), x)
                comm.all_gather(list(ref), x, group=gloo)
                if not torch.equal(out, ref):
                    bad.append(f"P={P} rank {rank} all_gather {dtype} n={n} symmetric={sym} differs from Gloo's")
                full = comm.symmetric_empty(P, n, dtype=dtype) if sym else torch.empty(P, n, dtype=dtype)
                full.copy_(torch.randint(-50, 50, (P, n), generator=g).to(dtype))
                for op in ("sum", "max"):
                    mine, theirs = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    comm.reduce_scatter(theirs, list(full.clone()), op=op, group=gloo)
                    comm.reduce_scatter(mine, list(full), op=op)
                    if not torch.equal(mine, theirs):
                        bad.append(f"P={P} rank {rank} reduce_scatter({op}) {dtype} n={n} symmetric={sym} differs")
    # last, on a group of its own (a failed collective aborts its group)
    odd = dist.new_group(list(range(P)))
    comm.set_transport("shm", odd)
    out = comm.symmetric_empty(P, 10, group=odd)  # allocated together (collective); rank 0 alone passes it
    out = out if rank == 0 else torch.empty(P, 10)
    try:
        comm.all_gather(list(out), torch.ones(10), group=odd)
        bad.append(f"rank {rank}: all_gather into symmetric memory against ordinary memory was not refused")
    except CommError as e:
        named = "rank 1 passed an ordinary tensor" if rank == 0 else "rank 0 passed symmetric allocation 0"
        if named not in str(e):
            bad.append(f"rank {rank}: unclear error for a symmetric/ordinary all_gather mix: {e}")
    comm.barrier(group=gloo)
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kernels", KERNELS)
def test_symmetric_all_gather_and_reduce_scatter_equal_gloo(P, kernels):
    run_ranks(_gather_scatter_symmetric, P, kernels, timeout=150)


def _compiled_bits_equal_python(rank: int) -> list[str]:
    """Random floats (rounding differs with the order of a sum): the compiled plane and the Python
    reference give the same bits for all_reduce, reduce_scatter and their symmetric forms, because
    both fold the ranks' parts in the same order with the same rounding; the compiled group's calls
    take the extension's fast path (its counter moves), the Python group's do not."""
    import torch.distributed as dist

    P = dist.get_world_size()
    shm.SLOT_BYTES = SMALL_SLOT
    groups = {}
    for k in ("compiled", "python"):
        groups[k] = dist.new_group(list(range(P)))
        comm.set_shm_kernels(k)
        comm.set_transport("shm", groups[k])
        comm.barrier(group=groups[k])  # a transport is built at its group's first call, with the kernels set then
    bad = []
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n in (1, 1001, BIG // 2):
            for op in ("sum", "avg", "prod", "max"):
                x = torch.randn(P, n, generator=g).to(dtype)
                got = {}
                for k, grp in groups.items():
                    a = x[0].clone()
                    comm.all_reduce(a, op=op, group=grp)
                    s = comm.symmetric_empty(n, dtype=dtype, group=grp)
                    s.copy_(x[1])
                    comm.all_reduce(s, op=op, group=grp)
                    full = comm.symmetric_empty(P, n, dtype=dtype, group=grp)
                    full.copy_(x)
                    rs, rs_sym = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                    comm.reduce_scatter(rs, list(x.clone()), op=op, group=grp)
                    comm.reduce_scatter(rs_sym, list(full), op=op, group=grp)
                    got[k] = (a, s.clone(), rs, rs_sym)
                for name, c, p in zip(("all_reduce", "symmetric all_reduce", "reduce_scatter",
                                       "symmetric reduce_scatter"), got["compiled"], got["python"]):
                    if not torch.equal(c, p):
                        d = (c.double() - p.double()).abs().max().item()
                        bad.append(f"P={P} rank {rank} {name}({op}) {dtype} n={n}: compiled differs from python by {d}")
    fast = fast_path(groups["compiled"])  # a plane is made, and its group offered, at the first call
    if fast is None or fast_path(groups["python"]) is not None or fast.calls < 4 * 3 * 4 * 3:
        bad.append(f"rank {rank}: the compiled group's calls did not take the fast path "
                   f"({fast.calls if fast else 0} calls), or the python group has one")
    return bad


@pytest.mark.timeout(300)
@pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))
def test_compiled_plane_gives_the_python_references_bits():
    run_ranks(_compiled_bits_equal_python, 3, timeout=280)


def test_compiled_kernels_without_the_extension_are_refused(monkeypatch):
    monkeypatch.setattr(compiled, "ext", None)
    monkeypatch.setattr(compiled, "MISSING", "the C++ extension distrain.comm.shm._dataplane is not built (test)")
    with pytest.raises(ConfigError, match="shm kernels 'compiled' asked for, but the C[+][+] extension .* not built"):
        comm.set_shm_kernels("compiled")
    with pytest.raises(ConfigError, match="shm kernels 'fast' unknown; use one of auto, compiled, python"):
        comm.set_shm_kernels("fast")
    assert compiled.kernels() == "python"


@pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_compiled_fold_equals_torch_for_every_op(dtype):
    """The extension's vectorised fold (out = x0 op x1 op ... in rank order) gives torch's bits for
    every dtype and op Gloo supports, over lengths that leave vector tails."""
    g = torch.Generator().manual_seed(5)
    for n in (1, 15, 64 + 33, 4099):
        for op in _ops(dtype):
            if dtype.is_floating_point:
                xs = [(torch.rand(n, generator=g) + 0.5).to(dtype) for _ in range(3)]
            else:
                xs = [_x(k, n, n, dtype, op) for k in range(3)]
            ref = xs[0].clone()
            for x in xs[1:]:
                ref = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum,
                       "max": torch.maximum, "band": torch.bitwise_and, "bor": torch.bitwise_or,
                       "bxor": torch.bitwise_xor}[op](ref, x)
            out = torch.empty(n, dtype=dtype)
            compiled.fold(out, xs, op)
            if op == "avg":
                ref = ref / 3 if dtype.is_floating_point else ref
            assert torch.equal(out, ref.to(dtype)), f"{dtype} {op} n={n}"


def _p2p(rank: int, kernels: str) -> list:
    """Ordered per pair and tag, other tags overtaking, messages larger than the ring."""
    import torch.distributed as dist

    comm.set_shm_kernels(kernels)
    comm.set_transport("shm")
    P = dist.get_world_size()
    out = []
    if rank == 0:
        big = torch.arange(3 * (1 << 18) + 5, dtype=torch.float64)  # 6 MiB: six times the ring
        works = [comm.isend(torch.full((3,), float(i)), 1, tag=5) for i in range(4)]
        works.append(comm.isend(torch.tensor([42]), 1, tag=9))
        works.append(comm.isend(big, 1, tag=5))
        for w in works:
            w.wait()
        comm.send_tensor(torch.ones(2, 3, dtype=torch.bfloat16), 2 % P)
    elif rank == 1:
        first = torch.empty(1, dtype=torch.int64)
        comm.recv(first, 0, tag=9)  # posted first although sent last but one: the tag-5 messages wait
        got = []
        for _ in range(4):
            t = torch.empty(3)
            comm.recv(t, 0, tag=5)
            got.append(t[0].item())
        big = torch.empty(3 * (1 << 18) + 5, dtype=torch.float64)
        comm.recv(big, 0, tag=5)
        out = [first.item(), got, bool(torch.equal(big, torch.arange(big.numel(), dtype=torch.float64)))]
        try:
            comm.recv(torch.empty(2), 2, tag=3)
        except CommError as e:
            out.append(str(e))
    elif rank == 2:
        t = comm.recv_tensor(0)
        out = [t.dtype == torch.bfloat16, tuple(t.shape)]
        comm.send(torch.zeros(5), 1, tag=3)  # 20 bytes into 8: a clear error on the receiver
    with comm.ledger() as led:
        for alg in ("star", "ring", "tree"):  # our algorithms run unchanged over the shm P2P
            t = torch.full((1000,), float(rank))
            comm.all_reduce(t, algorithm=alg)
            out.append(bool(torch.all(t == sum(range(P)))))
    from distrain.comm.algorithms import cost  # the ledger counts the shm messages exactly as Gloo's

    out.append(led.bytes_sent("all_reduce", "ring") == cost.traffic("all_reduce", "ring", P, rank, 1000)[0])
    # every peer has mapped this rank's segment: its files are gone from /dev/shm already
    out.append([n for n in os.listdir(shm_segment.SHM_DIR) if n.startswith(f"distrain-{os.getpid()}-")] == [])
    return out


def _pipelined_with_a_late_rank(rank: int, kernels: str) -> list[str]:
    """The pipelined all_reduce (up to SLOTS - 1 chunks in flight) when one rank runs late: the
    others fill the window and wait for it to read (CONSUMED) before reusing a slot. Interleaved
    with lock-step collectives, whose first write reuses a slot at once. Every result equals Gloo's."""
    import time

    P, gloo = _shm_world_beside_gloo(kernels)
    bad = []
    for it in range(6):
        late = it % P  # a different rank runs late each time, by 30 ms: the others fill their window
        n = (SMALL_SLOT // 4) * (3 + 2 * it) + 5  # 3..13 chunks of SMALL_SLOT, plus a piece
        x = _x(rank, 100 + it, n, torch.float32, "sum")
        if rank == late:
            time.sleep(0.03)
        a, b = x.clone(), x.to(torch.float64, copy=True)
        comm.all_reduce(a)
        comm.all_reduce(b, group=gloo)
        if not torch.equal(a, b.to(torch.float32)):
            bad.append(f"P={P} rank {rank} iteration {it}: pipelined all_reduce differs from Gloo's")
        ts = [x[:7].clone(), x[7:].clone()]
        ref = x.to(torch.float64, copy=True)
        comm.all_reduce(ref, group=gloo)
        if rank == (late + 1) % P:
            time.sleep(0.03)
        comm.all_reduce_list(ts)
        if not torch.equal(torch.cat(ts), ref.to(torch.float32)):
            bad.append(f"P={P} rank {rank} iteration {it}: pipelined all_reduce_list differs from Gloo's")
        c = _x(it % P, 200 + it, 4099, torch.float32, "sum")  # lock-step: writes its slot at once
        got = c.clone() if rank == it % P else torch.zeros(4099)
        comm.broadcast(got, src=it % P)
        if not torch.equal(got, c):
            bad.append(f"P={P} rank {rank} iteration {it}: broadcast after a pipelined all_reduce differs")
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("kernels", KERNELS)
def test_pipelined_all_reduce_with_a_late_rank_equals_gloo(P, kernels):
    run_ranks(_pipelined_with_a_late_rank, P, kernels, timeout=100)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kernels", KERNELS)
def test_p2p_over_shared_memory(kernels):
    r0, r1, r2 = distrain.spawn(_p2p, 3, args=(kernels,), timeout=150)
    assert r1[:3] == [42, [0.0, 1.0, 2.0, 3.0], True]
    assert r1[3] == ("irecv on rank 1 from rank 2 (tag 3): the message has 20 bytes but the receiving tensor "
                     "has 8; sender and receiver must agree on the size")
    assert r2[:2] == [True, (2, 3)]
    for r in (r0, r1, r2):
        assert r[-5:] == [True, True, True, True, True]


def _hierarchical(rank: int, hosts: list[str]) -> list[str]:
    import torch.distributed as dist

    shm.set_host_id(hosts[rank])  # one machine made to look like several
    shm.SLOT_BYTES = SMALL_SLOT
    P = dist.get_world_size()
    gloo = dist.new_group(list(range(P)))
    comm.set_transport("torch", gloo)
    comm.set_transport("auto")
    bad = []
    for case, (dtype, n, op) in enumerate([(torch.float32, 7, "sum"), (torch.float64, BIG, "sum"),
                                           (torch.int32, 1000, "max"), (torch.float32, 3, "avg"),
                                           (torch.int64, 2, "prod"), (torch.bool, 5, "bor")]):
        x = _x(rank, case, n, dtype, op)
        a, b = x.clone(), x.clone()
        with comm.ledger() as led:
            comm.all_reduce(a, op=op)
        comm.all_reduce(b, op=op, group=gloo)
        if not torch.equal(a, b):
            bad.append(f"rank {rank} {dtype} n={n} {op}: {a[:4].tolist()} vs {b[:4].tolist()}")
        leader = hosts.index(hosts[rank]) == rank
        between = led.bytes_sent("all_reduce", "hierarchical")
        if (between > 0) != leader:
            bad.append(f"rank {rank}: leader={leader} but sent {between} bytes between hosts")
    lst = [torch.zeros(2) for _ in range(P)]  # other collectives: torch's, across the hosts
    comm.all_gather(lst, torch.full((2,), float(rank)))
    if [t[0].item() for t in lst] != [float(q) for q in range(P)]:
        bad.append(f"rank {rank}: all_gather over hosts gave {lst}")
    if comm.transport_of() != "auto":
        bad.append(f"transport_of() = {comm.transport_of()}")
    return bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("hosts", [["a", "a", "b", "b", "b"], ["a", "b", "a", "c"]])
def test_hierarchical_all_reduce_on_two_pretend_hosts(hosts):
    run_ranks(_hierarchical, len(hosts), hosts, timeout=200)


def _strict_refuses_other_host(rank: int) -> str:
    shm.set_host_id(f"host{rank}")
    comm.set_transport("shm")
    try:
        comm.all_reduce(torch.ones(3))
        return "no error"
    except CommError as e:
        return str(e)


@pytest.mark.timeout(120)
def test_shm_transport_refuses_ranks_on_other_hosts():
    msgs = distrain.spawn(_strict_refuses_other_host, 2, timeout=90)
    assert "transport 'shm' needs every rank on one host, but rank 1 is on host1" in msgs[0]
    assert "use transport 'auto'" in msgs[0]


def _late_peer(rank: int, kernels: str, gave_up: str) -> str:
    import time

    comm.set_shm_kernels(kernels)
    comm.set_default_transport("shm", timeout=1.5)
    comm.all_reduce(torch.ones(2))  # both present
    if rank == 1:  # never calls the second all_reduce; stays alive until rank 0 has given up on it
        deadline = time.monotonic() + 60
        while not os.path.exists(gave_up) and time.monotonic() < deadline:
            time.sleep(0.05)
        return ""
    try:
        comm.all_reduce(torch.ones(2))
        return "no error"
    except CommError as e:
        return str(e)
    finally:
        open(gave_up, "w").close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernels", KERNELS)
def test_wait_honours_the_timeout_and_names_the_peer(kernels, tmp_path):
    msg = distrain.spawn(_late_peer, 2, args=(kernels, str(tmp_path / "gave-up")), timeout=90)[0]
    assert msg.startswith("all_reduce(transport=shm) on rank 0: timed out after 1.5s waiting for rank(s) [0, 1]") \
        or msg.startswith("all_reduce(transport=shm) on rank 0: timed out after 1.5s waiting for rank(s) [1]"), msg


def _victim_run(rank: int, port: int, world: int, out_dir: str, kernels: str) -> None:
    init_raw_rank(rank, port, world, kernels)
    t = torch.ones(1 << 20)
    for _ in range(3):
        comm.all_reduce(t)
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)  # dies between two collectives of its peers
    try:
        for _ in range(100):
            comm.all_reduce(t)
        msg = "no error"
    except CommError as e:
        msg = str(e)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as f:
        f.write(msg)
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kernels", KERNELS)
def test_killed_peer_is_named_and_leaves_no_files(tmp_path, kernels):
    procs = raw_ranks(_victim_run, 3, tmp_path, kernels)
    assert procs[2].exitcode == -signal.SIGKILL
    for r in (0, 1):
        msg = (tmp_path / f"rank{r}").read_text()
        assert msg.startswith(f"all_reduce(transport=shm) on rank {r}: rank 2 (pid {procs[2].pid}) died") or \
            msg.startswith(f"all_reduce(transport=shm) on rank {r}: rank "), msg
        assert "rank 2" in msg or "failed during this collective" in msg, msg
    assert shm_files_of(procs) == []


def test_full_dev_shm_says_how_much_and_how_to_fall_back(monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    lay = shm_segment.Layout(size=2, slot_bytes=1 << 20, ring_bytes=1 << 20)
    name = shm_segment.new_name("t", 0)
    with pytest.raises(CommError, match=rf"cannot allocate {lay.total} bytes in /dev/shm \(No space left on device; "
                                        rf"\d+ bytes free\); free space in /dev/shm or use --transport torch"):
        shm_segment.create(name, lay)
    assert not os.path.exists(os.path.join(shm_segment.SHM_DIR, name))


def _symmetric_on_a_full_dev_shm(rank: int) -> list:
    import logging

    comm.set_transport("shm")
    comm.barrier()
    if rank == 1:  # this rank's /dev/shm is full: every rank must fall back alike
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, "No space left on device")
        os.posix_fallocate = full
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logging.getLogger("distrain.comm").addHandler(handler)
    x = comm.symmetric_empty(1000)
    x.fill_(rank + 1)
    comm.all_reduce(x)
    return [_symmetric(x), bool(torch.equal(x, torch.full((1000,), 3.0))), seen]


@pytest.mark.timeout(60)
def test_symmetric_memory_falls_back_on_every_rank_when_one_cannot_allocate():
    for rank, (symmetric, right, seen) in enumerate(distrain.spawn(_symmetric_on_a_full_dev_shm, 2, timeout=45)):
        assert not symmetric and right, rank
        assert len(seen) == 1 and seen[0].startswith(f"symmetric_empty: ordinary memory on rank {rank} (group of 2 "
                                                     f"ranks): "), seen
        # 4096 bytes of data and the page holding the allocation's token (symmetric.py)
        assert "rank 1: shared-memory transport: cannot allocate 8192 bytes in /dev/shm (No space left on device" \
            in seen[0], seen


def test_stale_segments_of_dead_processes_are_swept():
    """A segment whose creator is gone (nobody holds its lock) is swept; one whose creator holds the
    lock stays, even with a pid of ours in its name (liveness is the lock: tests/test_shm_trust.py)."""
    import fcntl

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = os.path.join(shm_segment.SHM_DIR, f"distrain-{dead.pid}-deadbeef-g0-r0")
    with open(stale, "wb") as f:
        f.write(b"x" * 100)
    mine = os.path.join(shm_segment.SHM_DIR, f"distrain-{os.getpid()}-cafecafe-g0-r0")
    with open(mine, "wb") as f:
        f.write(b"x")
    held = os.open(mine, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_SH)
    try:
        removed = shm_segment.sweep_stale()
        assert os.path.basename(stale) in removed and not os.path.exists(stale)
        assert os.path.exists(mine)  # a live process's segment stays
    finally:
        os.close(held)
        os.unlink(mine)


def test_transport_names_are_checked():
    with pytest.raises(ConfigError, match=r"set_default_transport: unknown transport 'tcp'; use one of auto, shm, torch"):
        comm.set_default_transport("tcp")


@pytest.mark.timeout(300)
def test_train_over_shared_memory_equals_single_process(tmp_path, tmp_path_factory):
    from conftest import reference_losses, trainer_config

    from distrain.trainer import train
    from distrain.trainer.metrics import read_metrics

    ref = reference_losses(tmp_path_factory, model="mlp-tiny", data="digits")
    for nproc, alg in [(3, "native"), (2, "ring")]:  # direct shm all_reduce; our ring over shm P2P
        cfg = trainer_config(tmp_path / f"shm{nproc}{alg}", strategy="ddp", nproc=nproc, algorithm=alg,
                             model="mlp-tiny", data="digits", transport="shm")
        train(cfg)
        got = [r["loss"] for r in read_metrics(os.path.join(cfg.out, "metrics.jsonl"))]
        assert len(got) == len(ref) == 5
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-11, atol=0,
                                   msg=lambda m: f"ddp x{nproc} ({alg}) over shm vs single: {m}")
    with pytest.raises(ConfigError, match=r"--transport 'tcp' is unknown; use one of auto, shm, torch"):
        train(trainer_config(tmp_path / "bad", transport="tcp"))
