"""torch.distributed's semantics where distrain used to differ (issue 10), each checked against torch.

One spawn runs every check on every rank and returns the list of failures (empty = pass), so a
failure names the rank, the algorithm and what differed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import distrain
from distrain import comm
from conftest import expect_error, run_ranks
from distrain.errors import CommError, ConfigError

ALGS = ["native", "star", "ring", "tree"]


def _leaf_and_grad(rank: int) -> list[str]:
    """nn.Parameter leaves (requires_grad, outside no_grad) and inputs that require grad."""
    P = torch.distributed.get_world_size()
    bad = []
    for alg in ALGS:
        p = torch.nn.Parameter(torch.full((5,), rank + 1.0))
        comm.all_reduce(p, algorithm=alg)
        if not torch.equal(p.detach(), torch.full((5,), P * (P + 1) / 2)) or not p.requires_grad:
            bad.append(f"{alg}: all_reduce on a Parameter gave {p.tolist()}")
        q = torch.nn.Parameter(torch.full((3, 2), float(rank)).t())  # a strided view, not contiguous
        comm.broadcast(q, src=P - 1, algorithm=alg)
        comm.reduce(q, dst=0, op="max", algorithm=alg)
        if not torch.equal(q.detach(), torch.full((2, 3), P - 1.0)):
            bad.append(f"{alg}: broadcast+reduce on a Parameter gave {q.tolist()}")
        x = torch.full((4,), float(rank), requires_grad=True)
        outs = [torch.empty(4) for _ in range(P)]
        comm.all_gather(outs, x, algorithm=alg)
        if [o[0].item() for o in outs] != [float(r) for r in range(P)]:
            bad.append(f"{alg}: all_gather of a requires_grad input gave {[o.tolist() for o in outs]}")
        rs = torch.nn.Parameter(torch.zeros(2))
        comm.reduce_scatter(rs, [torch.full((2,), float(r + rank), requires_grad=True) for r in range(P)],
                            algorithm=alg)
        want = float(sum(rank + r for r in range(P)))
        if not torch.equal(rs.detach(), torch.full((2,), want)):
            bad.append(f"{alg}: reduce_scatter into a Parameter gave {rs.tolist()} want {want}")
    return bad


def _dtypes_and_ops(rank: int) -> list[str]:
    """complex (sum/avg), bool sum/prod = OR/AND, ReduceOp objects: equal to torch's native result."""
    import torch.distributed as dist

    P = dist.get_world_size()
    bad = []
    z = torch.tensor([rank + 1j * (rank + 1), -2.0 + 0.5j], dtype=torch.complex128)
    bits = torch.tensor([rank == 0, True, False, rank % 2 == 1])
    for alg in ALGS:
        for dtype in (torch.complex64, torch.complex128):
            ref = z.to(dtype).clone()
            dist.all_reduce(ref)
            for op in ("sum", "avg", dist.ReduceOp.SUM):
                got = z.to(dtype).clone()
                comm.all_reduce(got, op=op, algorithm=alg)
                want = ref / P if op == "avg" else ref
                if not torch.allclose(got, want, rtol=1e-6, atol=0):
                    bad.append(f"{alg} {dtype} all_reduce {op}: {got.tolist()} want {want.tolist()}")
            b = z.to(dtype).clone()
            comm.broadcast(b, src=1, algorithm=alg)
            outs = [torch.empty(2, dtype=dtype) for _ in range(P)]
            comm.all_gather(outs, z.to(dtype), algorithm=alg)
            sc = torch.empty(2, dtype=dtype)
            comm.scatter(sc, [z.to(dtype) * (r + 1) for r in range(P)] if rank == 0 else None, src=0, algorithm=alg)
            zr = [torch.tensor([r + 1j * (r + 1), -2.0 + 0.5j], dtype=dtype) for r in range(P)]
            if not (torch.equal(b, zr[1]) and all(torch.equal(o, w) for o, w in zip(outs, zr))
                    and torch.equal(sc, z.to(dtype) * (rank + 1) if rank == 0 else zr[0] * (rank + 1))):
                bad.append(f"{alg} {dtype}: broadcast/all_gather/scatter of complex differ")
            err = expect_error(lambda: comm.all_reduce(z.to(dtype).clone(), op="max", algorithm=alg), ConfigError,
                               "all_reduce does not support", "'max'", str(dtype), "'sum' and 'avg'")
            if err:
                bad.append(f"{alg} complex max: {err}")
        for op, native in (("sum", dist.ReduceOp.SUM), ("prod", dist.ReduceOp.PRODUCT)):
            ref = bits.clone()
            dist.all_reduce(ref, op=native)
            got = bits.clone()
            comm.all_reduce(got, op=op, algorithm=alg)
            if not torch.equal(got, ref):
                bad.append(f"{alg} bool {op}: {got.tolist()} want torch's {ref.tolist()}")
        t = torch.full((3,), float(rank))
        comm.all_reduce(t, op=dist.ReduceOp(dist.ReduceOp.MAX), algorithm=alg)
        if not torch.equal(t, torch.full((3,), P - 1.0)):
            bad.append(f"{alg}: ReduceOp(MAX) object gave {t.tolist()}")
    for alg in ALGS[1:]:
        err = expect_error(lambda: comm.all_reduce(torch.ones(3, 3).to_sparse(), algorithm=alg), ConfigError,
                           "all_reduce", "sparse", ".to_dense()")
        if err:
            bad.append(f"sparse {alg}: {err}")
    sp = (torch.eye(3) * (rank + 1)).to_sparse()
    comm.all_reduce(sp)  # native: Gloo's sparse all-reduce, as torch
    if not torch.equal(sp.to_dense(), torch.eye(3) * P * (P + 1) / 2):
        bad.append(f"native sparse all_reduce gave {sp.to_dense().tolist()}")
    return bad


def _groups_and_p2p(rank: int) -> list[str]:
    """Non-member no-op, group_src/group_dst, any-source recv, tags, barrier timeout, handles."""
    import torch.distributed as dist

    P = dist.get_world_size()
    bad = []
    sub = dist.new_group([1, 2])  # rank 0 is not a member
    for alg in ALGS:
        t = torch.full((2,), float(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            r = comm.all_reduce(t, group=sub, algorithm=alg)
            comm.broadcast(t, group=sub, group_src=1, algorithm=alg)  # group rank 1 = global rank 2
        if rank == 0:
            if r is not None or not torch.equal(t, torch.zeros(2)):
                bad.append(f"{alg}: non-member all_reduce was not a no-op")
            if not any("not a member" in str(w.message) for w in caught):
                bad.append(f"{alg}: non-member call gave no warning")
        elif not torch.equal(t, torch.full((2,), 3.0)):
            bad.append(f"{alg}: member all_reduce+broadcast(group_src=1) gave {t.tolist()}")
        out = torch.zeros(2)
        comm.reduce(out.add_(rank), dst=None, group_dst=0, algorithm=alg)  # world group rank 0
        if rank == 0 and out[0].item() != P * (P - 1) / 2:
            bad.append(f"{alg}: reduce(group_dst=0) gave {out.tolist()}")
    err = expect_error(lambda: comm.broadcast(torch.ones(1), src=0, group_src=0), ConfigError, "not both")
    if err:
        bad.append(f"src and group_src: {err}")
    # any-source recv returns the sender; the largest user tag works; the collective range is refused
    big = (1 << 30) - 1
    if rank == 0:
        senders = set()
        for _ in range(P - 1):
            buf = torch.empty(3)
            who = comm.recv(buf, src=None, tag=big)
            senders.add(who)
            if not torch.equal(buf, torch.full((3,), float(who))):
                bad.append(f"any-source recv from {who} got {buf.tolist()}")
        if senders != set(range(1, P)):
            bad.append(f"any-source recv returned {senders}")
        if comm.recv(buf, src=1) != 1:
            bad.append("recv(src=1) did not return 1")
    else:
        comm.send(torch.full((3,), float(rank)), dst=0, tag=big)
        if rank == 1:
            comm.send(torch.ones(3), dst=0)
    err = expect_error(lambda: comm.send(torch.ones(1), dst=(rank + 1) % P, tag=1 << 30), ConfigError, "tag", "2**30")
    if err:
        bad.append(f"collective tag range: {err}")
    comm.barrier(timeout=60)
    for alg in ALGS:
        t = torch.full((4,), float(rank))
        h = comm.all_reduce(t, algorithm=alg, async_op=True)
        fut = h.get_future()
        val = fut.wait()
        if h.exception() is not None or not torch.equal(val[0], torch.full((4,), P * (P - 1) / 2)):
            bad.append(f"{alg}: get_future value {val}")
        outs = [torch.empty(1) for _ in range(P)]
        h = comm.all_gather(outs, torch.full((1,), float(rank)), algorithm=alg, async_op=True)
        if [o.item() for o in h.result()] != [float(r) for r in range(P)]:
            bad.append(f"{alg}: all_gather result() {h.result()}")
    return bad


def _barrier_times_out(rank: int, gave_up: str) -> str:
    import time
    from pathlib import Path

    if rank == 1:  # never enters the barrier; stays alive until rank 0 has given up on it (its file says so)
        deadline = time.monotonic() + 60
        while not Path(gave_up).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return "skipped"
    try:
        comm.barrier(timeout=2, algorithm="ring")
    except CommError as e:
        return str(e)
    finally:
        Path(gave_up).touch()
    return "returned"


def _own_init(rank: int) -> list:
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo")
    t = torch.full((2,), float(rank))
    comm.all_reduce(t, algorithm="tree")
    return [dist.get_rank(), dist.get_world_size(), t[0].item()]


@pytest.mark.timeout(240)
def test_parameters_and_grad_inputs_work_on_every_algorithm():
    run_ranks(_leaf_and_grad, 3, timeout=200)


@pytest.mark.timeout(240)
def test_complex_bool_reduceop_sparse_as_torch():
    run_ranks(_dtypes_and_ops, 3, timeout=200)


@pytest.mark.timeout(240)
def test_groups_p2p_handles_as_torch():
    run_ranks(_groups_and_p2p, 3, timeout=200)


@pytest.mark.timeout(120)
def test_barrier_timeout_raises_instead_of_hanging(tmp_path):
    out = distrain.spawn(_barrier_times_out, 2, args=(str(tmp_path / "gave-up"),), timeout=90)
    assert "barrier(algorithm=ring" in out[0] and "not completed within 2" in out[0], out


@pytest.mark.timeout(120)
def test_spawn_init_false_runs_code_that_initialises_itself():
    assert distrain.spawn(_own_init, 3, init=False, timeout=90) == [[r, 3, 3.0] for r in range(3)]


DEBUG_SCRIPT = textwrap.dedent("""
    import sys, torch, distrain
    from distrain import comm
    info = distrain.runtime.init(timeout=60)
    assert comm.debug_enabled()
    for alg in ("native", "star", "ring", "tree"):
        for op in ("sum", "max", "avg"):
            t = torch.full((3,), float(info.rank))
            comm.all_reduce(t, op=op, algorithm=alg)
            comm.reduce(t, dst=0, op=op, algorithm=alg)
    with open(f"{sys.argv[1]}/rank{info.rank}.txt", "w") as f:
        f.write("ok")
    distrain.runtime.shutdown()
""")


@pytest.mark.timeout(150)
def test_debug_fingerprint_agrees_across_interpreters(tmp_path):
    """Under `distrain launch` every rank is a fresh interpreter (own hash() salt)."""
    script = tmp_path / "job.py"
    script.write_text(DEBUG_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(DISTRAIN_DEBUG="1", PYTHONHASHSEED="random")
    p = subprocess.run([sys.executable, "-m", "distrain.cli", "launch", "--nproc-per-node", "2", str(script),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=140)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["ok", "ok"]
