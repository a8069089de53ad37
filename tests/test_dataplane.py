"""The compiled data plane (comm/shm/_dataplane.cpp) tied to its Python twin mechanically.

* Its constants: the extension exports every number it restates (codes, the segment's lines,
  ring and symmetric-memory constants, the waits' timings), compiled.check_extension compares
  them with the Python reference at import, and a build from other source is one typed line.
* Its fast path (compiled.FastPath) against the dispatcher: after the same calls, the same
  sequence number, ledger and watchdog state, and the same bits.
* Mixed kernels: a group whose ranks run different kernels (compiled and Python) gives Gloo's
  results for every collective the data plane implements, and point-to-point.
* The fast tier's direct check: two Planes over real /dev/shm segments in one process.

Tests that need the extension skip, with the reason, where it is not built (no compiler).
"""

from __future__ import annotations

import importlib.util
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import distrain
from distrain import comm
from distrain.comm.core import watchdog
from distrain.comm.core.group import fast_path, resolve
from distrain.comm.shm import compiled, segment
from distrain.comm.shm import transport as shm
from distrain.errors import DataPlaneMismatchError

from conftest import run_ranks

pytestmark = pytest.mark.skipif(not shm.supported(), reason="shared-memory transport needs x86-64 and /dev/shm")
NEEDS_EXT = pytest.mark.skipif(compiled.ext is None, reason=str(compiled.MISSING))
SMALL_SLOT = 64 << 10  # small slots and rings: messages of a few hundred KiB span several


# ---------------------------------------------------------------------------------------------
# 1. The constants
# ---------------------------------------------------------------------------------------------

def _faithful_build() -> types.ModuleType:
    """A stand-in for the extension module that exports exactly the reference's numbers."""
    fake = types.ModuleType("distrain.comm.shm._dataplane")
    fake.__file__ = "/build/_dataplane.so"
    for name, value in compiled.reference().items():
        setattr(fake, name, value)
    for name in compiled.CALLS:
        setattr(fake, name, lambda *a: 0)
    return fake


@NEEDS_EXT
def test_the_built_extension_exports_every_constant_and_each_equals_pythons():
    exported = {k for k in dir(compiled.ext) if k.isupper()}
    assert exported == set(compiled.reference()), "an exported constant is not checked, or a checked one not exported"
    compiled.check_extension(compiled.ext)  # what the import ran: it passes for this build
    assert {k: getattr(compiled.ext, k) for k in exported} == compiled.reference()


def test_a_build_from_other_source_is_one_line_naming_both_values():
    fake = _faithful_build()
    compiled.check_extension(fake)  # the same numbers: accepted

    fake.OP_SUM = 3
    with pytest.raises(DataPlaneMismatchError) as e:
        compiled.check_extension(fake)
    assert str(e.value) == ("the compiled data plane (/build/_dataplane.so) says OP_SUM=3, the Python kernels say 0; "
                            "rebuild it (make install)")

    fake = _faithful_build()
    fake.SPIN_MAX_S = 2e-3
    with pytest.raises(DataPlaneMismatchError) as e:
        compiled.check_extension(fake)
    assert str(e.value) == ("the compiled data plane (/build/_dataplane.so) says SPIN_MAX_S=0.002, the Python kernels "
                            "say 0.001; rebuild it (make install)")

    fake = _faithful_build()
    fake.HEADER = 16.0  # the right value as a float is a different build too
    with pytest.raises(DataPlaneMismatchError, match=r"says HEADER=16\.0, the Python kernels say 16;"):
        compiled.check_extension(fake)

    fake = _faithful_build()
    del fake.LINE_SYMMETRIC  # an older build that does not export it
    with pytest.raises(DataPlaneMismatchError) as e:
        compiled.check_extension(fake)
    assert str(e.value) == ("the compiled data plane (/build/_dataplane.so) has no LINE_SYMMETRIC, the Python kernels "
                            "say 7: it was built from older source; rebuild it (make install)")

    fake = _faithful_build()
    del fake.stream_copy  # an older build without a function called here
    with pytest.raises(DataPlaneMismatchError) as e:
        compiled.check_extension(fake)
    assert str(e.value) == ("the compiled data plane (/build/_dataplane.so) has no stream_copy(): it was built from "
                            "older source; rebuild it (make install)")


@NEEDS_EXT
def test_stream_copy_is_torchs_copy_byte_for_byte_at_any_length_and_alignment():
    """compiled.stream_copy (non-temporal stores: pieces.InPlace's per-step pack) writes what dst.copy_(src)
    writes, and nothing around it, for lengths and destination offsets off the 32-byte vectors; with the
    Python kernels, or tensors it does not take (non-contiguous), it is torch's copy."""
    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 31, 32, 63, 64, 65, 1000, 4099):
        for off in (0, 1, 8, 33):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
            dst = torch.full((n + off + 7,), 9, dtype=torch.uint8)
            assert compiled.ext.stream_copy(dst[off:off + n], src) == compiled.OK
            want = torch.full((n + off + 7,), 9, dtype=torch.uint8)
            want[off:off + n].copy_(src)
            assert torch.equal(dst, want), (n, off)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    out = torch.zeros(5, 6, dtype=torch.float64)
    assert compiled.ext.stream_copy(out, x.t()) == compiled.UNSUPPORTED  # (non-contiguous: the caller copies)
    compiled.stream_copy(out, x.t())
    assert torch.equal(out, x.t())


def test_importing_the_kernels_beside_a_stale_build_raises_at_import(monkeypatch):
    """compiled.py, imported afresh with a stand-in extension whose op code differs, fails its import."""
    import sys

    from distrain.comm import shm as shm_package

    fake = _faithful_build()
    fake.OP_MAX = 2
    monkeypatch.setitem(sys.modules, "distrain.comm.shm._dataplane", fake)
    monkeypatch.setattr(shm_package, "_dataplane", fake, raising=False)
    spec = importlib.util.spec_from_file_location("distrain_compiled_probe", compiled.__file__)
    with pytest.raises(DataPlaneMismatchError) as e:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert str(e.value) == ("the compiled data plane (/build/_dataplane.so) says OP_MAX=2, the Python kernels say 3; "
                            "rebuild it (make install)")


# ---------------------------------------------------------------------------------------------
# 5. The fast tier's direct check: two ranks' Planes over /dev/shm segments, in one process
# ---------------------------------------------------------------------------------------------

@NEEDS_EXT
def test_compiled_all_reduce_over_shm_of_two_ranks_is_torchs_own_result_bit_for_bit():
    """Rank 0 on this thread, rank 1 on another, each with the extension's Plane over the same two
    segments (segment.create: the files and layout the transport uses): the sum of two is torch's
    x0 + x1 (what Gloo computes for two ranks) bit for bit, in one slot and over several (pipelined)."""
    P = 2
    lay = segment.Layout(P, SMALL_SLOT, 4096, shm.SLOTS)
    segs = [segment.create(segment.new_name("dataplane-check", q), lay) for q in range(P)]
    try:
        base = [s.bytes.data_ptr() for s in segs]
        planes = [compiled.ext.Plane(q, P, lay.slots, lay.slot_bytes, base, [b + lay.coll_offset for b in base],
                                     [s.wake_fd for s in segs], [-1] * P, 30.0, threading.main_thread().ident)
                  for q in range(P)]
        g = torch.Generator().manual_seed(11)
        cases = [(torch.float32, "sum", 1001), (torch.float32, "sum", 3 * SMALL_SLOT // 4 + 5),
                 (torch.bfloat16, "sum", 4099), (torch.float64, "avg", 2000), (torch.int64, "max", 777)]
        with ThreadPoolExecutor(1) as pool:
            for dtype, op, n in cases:
                xs = [(torch.randn(n, generator=g) * 1000).to(dtype) for _ in range(P)]
                bufs = [x.clone() for x in xs]
                other = pool.submit(planes[1].all_reduce, bufs[1], compiled.CODES[op])
                rcs = (planes[0].all_reduce(bufs[0], compiled.CODES[op]), other.result(timeout=30))
                assert rcs == (compiled.OK, compiled.OK), f"{dtype} {op} n={n}: statuses {rcs}"
                want = {"sum": xs[0] + xs[1], "avg": (xs[0] + xs[1]) / 2, "max": torch.maximum(xs[0], xs[1])}[op]
                for q in range(P):
                    assert torch.equal(bufs[q], want), f"{dtype} {op} n={n}: rank {q} differs from torch"
        assert planes[0].step == planes[1].step > len(cases)  # the large case took several steps
    finally:
        for s in segs:
            s.close()


# ---------------------------------------------------------------------------------------------
# 3. The fast path leaves what the dispatcher leaves
# ---------------------------------------------------------------------------------------------

def _sequence(rank: int, P: int, group) -> list[torch.Tensor]:
    """Ten blocking native calls; every one but the non-contiguous all_reduce is one the fast path takes
    (that one it declines, and the dispatcher runs it). Returns every result."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    comm.barrier(group=group)
    a = torch.randn(3001, generator=g)
    comm.all_reduce(a, op="sum", group=group)
    b = torch.randn(500, generator=g, dtype=torch.float64)
    comm.all_reduce(b, op="avg", group=group)
    c = torch.randint(-50, 50, (64,), generator=g)
    comm.all_reduce(c, op="max", group=group)
    d = torch.randn(40, 30, generator=g).t()  # not contiguous: declined by the fast path
    comm.all_reduce(d, op="sum", group=group)
    e = torch.randn(777, generator=g) if rank == 1 else torch.zeros(777)
    comm.broadcast(e, src=1, group=group)
    f = [torch.empty(129) for _ in range(P)]
    comm.all_gather(f, torch.randn(129, generator=g), group=group)
    h = torch.empty(250)
    comm.reduce_scatter(h, [torch.randn(250, generator=g) for _ in range(P)], op="sum", group=group)
    k = torch.empty(33, dtype=torch.int32)
    comm.reduce_scatter(k, [torch.randint(0, 9, (33,), generator=g, dtype=torch.int32) for _ in range(P)],
                        op="min", group=group)
    comm.barrier(group=group)
    out += [a, b, c, d, e, *f, h, k]
    return out


CALLS, FAST_CALLS = 10, 9


def _bookkeeping(rank: int) -> list[str]:
    import torch.distributed as dist

    P = dist.get_world_size()
    groups = {}
    for name, kernels, fast in (("fast path", "compiled", True), ("dispatcher", "compiled", False),
                                ("python", "python", True)):
        compiled.set_fast_path(fast)
        comm.set_shm_kernels(kernels)
        groups[name] = dist.new_group(list(range(P)))
        comm.set_transport("shm", groups[name])
        comm.barrier(group=groups[name])  # the transport is built (with the kernels set now) ...
        comm.barrier(group=groups[name])  # ... and a compiled group offered to the fast path after a step
    compiled.set_fast_path(True)
    wd = watchdog.current()
    if wd is None:
        return ["no watchdog is installed in the rank (runtime.init installs one)"]
    got = {}
    for name, grp in groups.items():
        st = resolve(grp, "test")
        fp = fast_path(grp)
        fast0 = fp.calls if fp is not None else None
        entered: list[tuple] = []  # (description, sequence number) per bracket

        def enter(op, seq=None, _entered=entered, _enter=type(wd).enter):
            _entered.append((op, seq))  # (both paths give the watchdog the same sequence number too)
            _enter(wd, op, seq)

        def withdraw(_entered=entered, _withdraw=type(wd).withdraw):  # a declined call: not counted
            _entered.pop()
            _withdraw(wd)

        # the dispatcher and the fast path call them through the instance: every bracket counted is seen
        wd.enter, wd.withdraw = enter, withdraw
        seq0, wd0 = st.seq, wd.calls
        try:
            with comm.ledger() as led:
                results = _sequence(rank, P, grp)
        finally:
            del wd.enter, wd.withdraw
        got[name] = {"sequence number": st.seq - seq0, "ledger": led.as_dict(), "watchdog calls": wd.calls - wd0,
                     "watchdog brackets": entered, "watchdog op after": wd.op, "results": results,
                     "fast path calls": None if fp is None else fp.calls - fast0}
    bad = []
    ref = got["fast path"]
    if ref["fast path calls"] != FAST_CALLS:
        bad.append(f"the fast path ran {ref['fast path calls']} of the calls, not {FAST_CALLS}")
    if ref["sequence number"] != CALLS or ref["watchdog calls"] != CALLS or len(ref["watchdog brackets"]) != CALLS:
        bad.append(f"fast path: {ref['sequence number']} sequence numbers, {ref['watchdog calls']} watchdog calls, "
                   f"{len(ref['watchdog brackets'])} brackets for {CALLS} calls")
    if ref["ledger"]["all_reduce/native"]["calls"] != 4 or ref["ledger"]["barrier/native"]["calls"] != 2:
        bad.append(f"fast path: ledger {ref['ledger']}")
    for name in ("dispatcher", "python"):
        if got[name]["fast path calls"] is not None:
            bad.append(f"the {name} group has a fast path")
        for key in ("sequence number", "ledger", "watchdog calls", "watchdog brackets", "watchdog op after"):
            if got[name][key] != ref[key]:
                bad.append(f"{key}: fast path {ref[key]!r}, {name} {got[name][key]!r}")
        for i, (x, y) in enumerate(zip(ref["results"], got[name]["results"])):
            if not torch.equal(x, y):
                bad.append(f"result {i}: the {name} group's differs from the fast path's")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(110)
@NEEDS_EXT
def test_fast_path_and_dispatcher_leave_the_same_sequence_number_ledger_and_watchdog_state():
    """The same ten calls on three groups of the same ranks: compiled with the fast path, compiled
    with the fast path off (the dispatcher into compiled.py's collectives), Python kernels: the same
    call count, ledger, watchdog count and brackets (each call's description), and the same bits."""
    run_ranks(_bookkeeping, 2, timeout=100)


# ---------------------------------------------------------------------------------------------
# 4. Ranks on different kernels in one group
# ---------------------------------------------------------------------------------------------

def _ints(seed: int, shape, dtype, lo: int = 0, hi: int = 6) -> torch.Tensor:
    """Small integers: sums and products exact in every dtype, whatever the order of reduction."""
    return torch.randint(lo, hi, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _mixed(rank: int, kernels: list[str]) -> list[str]:
    """Every collective of the data plane, on the shm world group whose ranks run ``kernels[rank]``,
    against the same call on a Gloo group of the same ranks; point-to-point around the ring."""
    import torch.distributed as dist

    P = dist.get_world_size()
    shm.SLOT_BYTES, shm.RING_BYTES = SMALL_SLOT, SMALL_SLOT
    gloo = dist.new_group(list(range(P)))
    comm.set_shm_kernels(kernels[rank])
    comm.set_transport("shm")
    comm.set_transport("torch", gloo)
    comm.barrier()
    comm.barrier()
    bad = []
    st = resolve(None, "test")
    if st.transport.kernels != kernels[rank] or (fast_path(None) is not None) != (kernels[rank] == "compiled"):
        bad.append(f"this rank runs {st.transport.kernels} kernels (fast path {fast_path(None)}), not {kernels[rank]}")

    def same(label, mine, ref):
        if not torch.equal(mine, ref.to(mine.dtype)):
            bad.append(f"{label}: shm {mine.flatten()[:4].tolist()} gloo {ref.flatten()[:4].tolist()}")

    case = 0
    # 1001: one slot, one phase; 40_000 float32 (156 KiB): several slots (pipelined at P=2, two phases at P=3)
    for dtype, n in ((torch.float32, 1001), (torch.float32, 40_000), (torch.int64, 3001), (torch.bfloat16, 513)):
        wide = torch.float64 if dtype.is_floating_point else torch.int64
        ops = ["sum", "avg", "prod", "min", "max"] if dtype.is_floating_point else ["sum", "prod", "max", "band", "bxor"]
        for op in ops:
            case += 1
            lo, hi = (1, 3) if op == "prod" else (0, 6)
            x = _ints(1000 * case + rank, (n,), dtype, lo, hi)
            root = case % P
            a, b = x.clone(), x.to(wide, copy=True)
            comm.all_reduce(a, op=op)
            comm.all_reduce(b, op=op, group=gloo)
            same(f"all_reduce {dtype} n={n} {op}", a, b)
            a, b = x.clone(), x.to(wide, copy=True)
            comm.reduce(a, dst=root, op=op)
            comm.reduce(b, dst=root, op=op, group=gloo)
            same(f"reduce {dtype} n={n} {op} to {root}", a, b if rank == root else x)
            ins = [_ints(1000 * case + 10 * rank + q, (n,), dtype, lo, hi) for q in range(P)]
            a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=wide)
            comm.reduce_scatter(a, [t.clone() for t in ins], op=op)
            comm.reduce_scatter(b, [t.to(wide, copy=True) for t in ins], op=op, group=gloo)
            same(f"reduce_scatter {dtype} n={n} {op}", a, b)
            s = comm.symmetric_empty(n, dtype=dtype)
            s.copy_(x)
            b = x.to(wide, copy=True)
            comm.all_reduce(s, op=op)
            comm.all_reduce(b, op=op, group=gloo)
            same(f"symmetric all_reduce {dtype} n={n} {op}", s, b)
            full = comm.symmetric_empty(P, n, dtype=dtype)
            full.copy_(torch.stack(ins))
            a = torch.empty(n, dtype=dtype)
            comm.reduce_scatter(a, list(full), op=op)
            b = torch.empty(n, dtype=wide)
            comm.reduce_scatter(b, [t.to(wide, copy=True) for t in ins], op=op, group=gloo)
            same(f"symmetric reduce_scatter {dtype} n={n} {op}", a, b)
        case += 1
        x, root = _ints(1000 * case + rank, (n,), dtype), case % P
        a, b = x.clone(), x.to(wide, copy=True)
        comm.broadcast(a, src=root)
        comm.broadcast(b, src=root, group=gloo)
        same(f"broadcast {dtype} n={n} from {root}", a, b)
        outs, refs = [torch.empty(n, dtype=dtype) for _ in range(P)], [torch.empty(n, dtype=wide) for _ in range(P)]
        comm.all_gather(outs, x)
        comm.all_gather(refs, x.to(wide, copy=True), group=gloo)
        same(f"all_gather {dtype} n={n}", torch.stack(outs), torch.stack(refs))
        full = comm.symmetric_empty(P, n, dtype=dtype)
        full[rank].copy_(x)
        comm.all_gather(list(full), full[rank])
        same(f"symmetric all_gather {dtype} n={n}", full, torch.stack(refs))
        got = [torch.empty(n, dtype=dtype) for _ in range(P)] if rank == root else None
        ref = [torch.empty(n, dtype=wide) for _ in range(P)] if rank == root else None
        comm.gather(x, got, dst=root)
        comm.gather(x.to(wide, copy=True), ref, dst=root, group=gloo)
        if rank == root:
            same(f"gather {dtype} n={n} to {root}", torch.stack(got), torch.stack(ref))
        lst = [_ints(1000 * case + 50 + q, (n,), dtype) for q in range(P)]
        a, b = torch.empty(n, dtype=dtype), torch.empty(n, dtype=wide)
        comm.scatter(a, lst if rank == root else None, src=root)
        comm.scatter(b, [t.to(wide, copy=True) for t in lst] if rank == root else None, src=root, group=gloo)
        same(f"scatter {dtype} n={n} from {root}", a, b)
        # point-to-point around the ring, a message of several rings (the Rings and the Python engine)
        msg = _ints(1000 * case + 70 + rank, (n * 3,), dtype)
        got = torch.empty(n * 3, dtype=dtype)
        works = [comm.isend(msg, (rank + 1) % P), comm.irecv(got, (rank - 1) % P)]
        for w in works:
            w.wait()
        same(f"send/recv {dtype} n={3 * n}", got, _ints(1000 * case + 70 + (rank - 1) % P, (n * 3,), dtype))
    comm.barrier()
    comm.barrier(group=gloo)
    return bad


@pytest.mark.timeout(300)
@NEEDS_EXT
@pytest.mark.parametrize("kernels", [["compiled", "python"], ["python", "compiled", "compiled"]],
                         ids=["P2-compiled-python", "P3-python-compiled-compiled"])
def test_ranks_on_different_kernels_give_gloos_results_for_every_collective(kernels):
    run_ranks(_mixed, len(kernels), kernels, timeout=280)
