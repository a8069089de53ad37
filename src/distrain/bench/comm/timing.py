"""The per-rank side of ``distrain bench comm``: one (op, size) cell timed on every rank.

What runs inside each spawned (or launched) rank: buffers, warm-up, the adaptive choice of
rounds and bursts, the interleaved timed rounds, the ledger's byte count and the reduction to
records (max over ranks per iteration, median over iterations). The method is described in
:mod:`distrain.bench.comm.collectives`, which parses the flags, spawns the ranks and reports.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from distrain.bench import background, common
from distrain.bench.comm import columns, predict, start
from distrain.bench.comm.report import bandwidths, busbw_factor, full_size, per_rank_count
from distrain.comm.core.ops import SUPPORTED_DTYPES
from distrain.errors import ConfigError

TARGET_S = 0.5  # adaptive iterations: about this long per cell ...
MIN_ITERS, MAX_ITERS = 5, 50  # ... but at least / at most this many iterations
BURST_S, MAX_BURST = 2e-3, 200  # calls back to back per timed sample: about 2 ms, at most 200
ROOT = 0

DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES if d != torch.bool}


SYMMETRIC = "+sym"  # column suffix: native on buffers in symmetric memory (comm.symmetric_empty)


def labels(algorithms: list[str], transports: list[str], symmetric: bool = False) -> list[str]:
    """Column labels: the algorithm on torch, ``alg@transport`` on the others, and with
    ``symmetric`` a ``native@transport+sym`` column for each shared-memory transport."""
    out = [a if t == "torch" else f"{a}@{t}" for t in transports if t != columns.DEEPSPEED for a in algorithms]
    if columns.DEEPSPEED in transports:
        out.append(columns.DEEPSPEED)
    if symmetric and "native" in algorithms:
        out += [f"native@{t}{SYMMETRIC}" for t in transports if t in ("shm", "auto")]
    return out


def _make_call(op: str, n: int, P: int, rank: int, dtype: torch.dtype, groups: dict,
               symmetric: dict | None = None) -> Callable[[str], None]:
    """Allocate op's buffers once; return call(label) doing one blocking collective.

    ``symmetric`` (transport -> its arena, grown as needed): the ``+sym`` columns' buffers are
    cut from a symmetric allocation of that transport's group, the others are ordinary tensors.
    """
    inner = _make_call_on(op, n, P, rank, lambda k: torch.zeros(k, dtype=dtype))
    sym = {t: _make_call_on(op, n, P, rank, _cutter(arena, op, n, P, rank, dtype, groups[t]))
           for t, arena in (symmetric or {}).items()}

    ds = groups.get(columns.DEEPSPEED)
    ds_buf = torch.zeros(n, dtype=dtype) if ds is not None else None

    def call(label: str) -> None:
        alg, _, t = label.partition("@")
        if alg == columns.DEEPSPEED:
            ds(ds_buf)
        elif t.endswith(SYMMETRIC):
            t = t.removesuffix(SYMMETRIC)
            sym[t](alg, groups[t])
        else:
            inner(alg, groups[t or "torch"])

    return call


def _cutter(arena: dict, op: str, n: int, P: int, rank: int, dtype: torch.dtype, group) -> Callable:
    """An allocator that cuts zeroed tensors from the transport's symmetric arena, growing it
    (a new collective allocation, the same on every rank) when this cell needs more."""
    from distrain import comm

    need = [0]
    _make_call_on(op, n, P, rank, lambda k: need.__setitem__(0, need[0] + k) or torch.empty(0))  # count only
    nbytes = need[0] * dtype.itemsize
    if arena.get("bytes", -1) < nbytes:
        arena["buf"], arena["bytes"] = comm.symmetric_empty(max(nbytes, 1), dtype=torch.uint8, group=group), nbytes
    at = [0]

    def z(k: int) -> torch.Tensor:
        t = arena["buf"][at[0]:at[0] + k * dtype.itemsize].view(dtype)
        at[0] += k * dtype.itemsize
        return t.zero_()

    return z


def _make_call_on(op: str, n: int, P: int, rank: int, z) -> Callable[[str, Any], None]:
    from distrain import comm

    if op == "all_reduce":
        t = z(n)
        return lambda a, g: comm.all_reduce(t, algorithm=a, group=g)
    if op == "broadcast":
        t = z(n)
        return lambda a, g: comm.broadcast(t, src=ROOT, algorithm=a, group=g)
    if op == "reduce":
        t = z(n)
        return lambda a, g: comm.reduce(t, dst=ROOT, algorithm=a, group=g)
    if op == "all_gather":
        t, lst = z(n), [z(n) for _ in range(P)]
        return lambda a, g: comm.all_gather(lst, t, algorithm=a, group=g)
    if op == "reduce_scatter":
        out, lst = z(n), [z(n) for _ in range(P)]
        return lambda a, g: comm.reduce_scatter(out, lst, algorithm=a, group=g)
    if op == "scatter":
        out, lst = z(n), ([z(n) for _ in range(P)] if rank == ROOT else None)
        return lambda a, g: comm.scatter(out, lst, src=ROOT, algorithm=a, group=g)
    if op == "gather":
        t, lst = z(n), ([z(n) for _ in range(P)] if rank == ROOT else None)
        return lambda a, g: comm.gather(t, lst, dst=ROOT, algorithm=a, group=g)
    if op == "barrier":
        return lambda a, g: comm.barrier(algorithm=a, group=g)
    raise ConfigError(f"unknown collective {op!r}")


def _timed_round(call, algs: list[str], order_shift: int, starter: start.Starter,
                 bursts: list[int]) -> tuple[list[float], list[float], list[float]]:
    """One sample of every algorithm (order rotated by order_shift): from the sample's start
    (:meth:`start.Starter.begin`: a common instant, or a barrier's exit), ``bursts[k]`` calls back to
    back; returns seconds per call, the actual start (rank 0's clock) and the lateness past the
    common start for each algorithm."""
    A = len(algs)
    out, starts, late = [0.0] * A, [0.0] * A, [0.0] * A
    for j in range(A):
        k = (j + order_shift) % A
        t0 = starter.begin()
        for _ in range(bursts[k]):
            call(algs[k])
        out[k] = (starter.clock() - t0) / bursts[k]
        starts[k], late[k] = starter.actual_start(), starter.late
    return out, starts, late


def _choose(last: list[float] | None, cfg: dict, call, algs: list[str], dist,
            starter: start.Starter) -> tuple[int, list[int]]:
    """Rounds and bursts, identical on every rank (from the slowest rank's warm-up calls)."""
    A = len(algs)
    if cfg["iters"] is not None and cfg["burst"] is not None:
        return cfg["iters"], [cfg["burst"]] * A
    if last is None:  # --warmup 0: one untimed probe round
        last = _timed_round(call, algs, 0, starter, [1] * A)[0]
    probe = torch.tensor(last, dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    t = probe.tolist()
    bursts = [cfg["burst"] or min(MAX_BURST, max(1, math.ceil(BURST_S / max(x, 1e-9)))) for x in t]
    round_s = max(sum(b * x for b, x in zip(bursts, t)) / A, 1e-9)  # per algorithm, like one call before
    iters = cfg["iters"] or common.adaptive_iters(round_s, cfg["target_s"], MIN_ITERS, MAX_ITERS)
    return iters, bursts


def time_case(rank: int, P: int, op: str, size: int, cfg: dict, dist, groups: dict,
              arenas: dict | None = None) -> list[dict]:
    """Time collective ``op`` on ``size`` bytes with every algorithm of cfg on this rank (collective:
    every rank calls it alike): one record per algorithm, times of the slowest rank per iteration."""
    from distrain import comm

    dtype = DTYPES[cfg["dtype"]]
    elem = torch.tensor([], dtype=dtype).element_size()
    algs = labels(cfg["algorithms"], cfg["transports"], cfg.get("symmetric", False))
    A = len(algs)
    n = per_rank_count(op, size, P, elem)
    S = full_size(op, n, P, elem)
    call = _make_call(op, n, P, rank, dtype, groups, arenas)

    starter = start.Starter(cfg.get("start", "window"), dist, rank, P)
    clocks = starter.sync()  # every rank's offset to rank 0's clock, once per cell
    last = None
    for w in range(cfg["warmup"]):
        last = _timed_round(call, algs, w, starter, [1] * A)[0]
    iters, bursts = _choose(last, cfg, call, algs, dist, starter)

    times = torch.zeros(3, A, iters, dtype=torch.float64)  # seconds per call, actual start, lateness
    for i in range(iters):
        times[:, :, i] = torch.tensor(_timed_round(call, algs, i, starter, bursts), dtype=torch.float64)

    # Traffic: one extra untimed call per algorithm under a ledger.
    traffic = torch.zeros(A, 2, dtype=torch.int64)
    for k, a in enumerate(algs):
        dist.barrier()
        with comm.ledger() as led:
            call(a)
        traffic[k, 0] = led.bytes_sent(op, a.partition("@")[0])  # deepspeed: 0 (outside our ledger)
        traffic[k, 1] = led.bytes_recv(op, a.partition("@")[0])

    all_times = [torch.empty_like(times) for _ in range(P)]
    dist.all_gather(all_times, times)
    all_traffic = [torch.empty_like(traffic) for _ in range(P)]
    dist.all_gather(all_traffic, traffic)

    records = []
    for k, a in enumerate(algs):
        per_rank = [t[0, k].tolist() for t in all_times]  # [rank][iteration]
        slowest = common.slowest_rank_times(per_rank)
        sec = common.median(slowest)
        algbw, busbw = bandwidths(op, S, P, sec)
        sent = [int(t[k, 0]) for t in all_traffic]
        recv = [int(t[k, 1]) for t in all_traffic]
        native = a.startswith("native") or a == columns.DEEPSPEED
        records.append({
            "P": P, "op": op, "algorithm": a, "dtype": cfg["dtype"], "transport": a if a == columns.DEEPSPEED else a.partition("@")[2] or "torch",
            "size_bytes": S, "requested_size_bytes": size if op != "barrier" else 0, "count": n,
            "iters": iters, "burst": bursts[k], "warmup": cfg["warmup"],
            "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw,
            "busbw_factor": busbw_factor(op, P),
            "bytes_sent_max_rank": None if native else max(sent),
            "bytes_recv_max_rank": None if native else max(recv),
            "bytes_sent_total": None if native else sum(sent),
            "times_us": [t * 1e6 for t in slowest],  # per iteration, slowest rank
            "rank_times_us": [[t * 1e6 for t in row] for row in per_rank],  # [rank][iteration]
            "start": dict(start.summary(starter.mode, [t[1, k].tolist() for t in all_times],
                                        [t[2, k].tolist() for t in all_times]),
                          late_us=[[x * 1e6 for x in t[2, k].tolist()] for t in all_times],  # [rank][iteration]
                          margin_us=starter.margin * 1e6 if starter.mode == "window" else None,
                          clock_offset_us=clocks["offset_us"], clock_sync_rtt_us=clocks["rtt_us"]),
        })
    return records


def run_rank(rank: int, cfg: dict) -> list[dict] | None:
    """Runs on every rank of one spawn; rank 0 returns the records."""
    import torch.distributed as dist

    P = dist.get_world_size()
    groups: dict[str, Any] = columns.transport_groups(cfg["transports"], P)  # a group of all ranks each
    if columns.DEEPSPEED in cfg["transports"]:
        groups[columns.DEEPSPEED] = columns.deepspeed_open(P, rank)
    # each shared-memory transport's symmetric arena for the +sym columns, kept across cells
    arenas = {t: {} for t in cfg["transports"] if t in ("shm", "auto")} if cfg.get("symmetric") else None
    records: list[dict] = []
    fabric = predict.setup(cfg["predict"], rank) if cfg.get("predict") else None
    sizes = cfg["sizes"]
    t_start = time.perf_counter()
    for op in cfg["ops"]:
        for size in (sizes if op != "barrier" else [0]):
            t0, load0 = time.perf_counter(), background.loadavg()
            recs = time_case(rank, P, op, size, cfg, dist, groups, arenas)
            load1 = background.loadavg()  # the cell is one measurement: its load at start and end
            for r in recs:
                r["loadavg_start"], r["loadavg_end"] = load0, load1
            if fabric is not None:
                predict.annotate(recs, fabric, torch.tensor([], dtype=DTYPES[cfg["dtype"]]).element_size())
            records += recs
            if rank == 0:
                cells = "  ".join(f"{r['algorithm']} {r['time_us']:.0f}us" for r in recs)
                common.progress(f"[P={P}] {op} {common.format_size(size) if size else '-'}: iters={recs[0]['iters']}  "
                                f"{cells}  ({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - t_start:.0f}s)")
    if columns.DEEPSPEED in groups:
        dist.barrier()
        if rank == 0:
            columns.deepspeed_close()
    return records if rank == 0 else None
