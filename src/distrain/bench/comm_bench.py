"""``distrain bench comm``: collective time and bandwidth, native Gloo vs our star/ring/tree.

An nccl-tests-style benchmark of the eight collectives of :mod:`distrain.comm`, with every
algorithm measured side by side in one run.

Method
------
For each world size P in ``--nproc``: one :func:`distrain.spawn` of P local ranks. Inside,
for each op, then each size:

1. allocate the buffers once (shared by all algorithms of that size; filled with zeros,
   so repeated sums stay finite and no denormals appear);
2. warm up: ``--warmup`` rounds, a round being one call of every algorithm;
3. choose the iteration count (unless ``--iters`` is given): from the last warm-up round,
   t = the slowest call (max over ranks and algorithms); iters = ceil(0.5 s / t) clamped
   to [5, 50], i.e. about half a second for the slowest algorithm of the cell, at least 5
   and at most 50 iterations. With ``--warmup 0`` one untimed probe round is run for it;
4. choose each algorithm's *burst* (unless ``--burst`` is given): ceil(BURST_S / its slowest
   warm-up call), clamped to [1, MAX_BURST], the same on every rank. A timed sample is one
   native ``torch.distributed.barrier()``, then ``burst`` blocking calls back to back
   (``async_op=False``), timed on each rank with ``time.perf_counter``, divided by ``burst``:
   nccl-tests' and the OSU benchmarks' method (many calls in a row, time over count). A lone
   call after a barrier would also time the barrier's exit skew between ranks and the wake-up
   of a rank that slept in it (hundreds of microseconds over Gloo), which hides a latency of a
   few microseconds; ``--burst 1`` gives that per-call method back. Bursts last about
   BURST_S, so at 1 MiB and above a burst is one call;
5. time ``iters`` rounds. In round i the algorithms run back to back in an order rotated
   by i (native, star, ring, tree; then star, ring, tree, native; ...) so that machine noise
   and cache state hit every algorithm alike;
6. gather every rank's per-iteration times to every rank (a native all_gather of a float64
   tensor); per iteration take the max over ranks (the slowest rank's time: a collective is
   done when its last rank is), then the median over iterations -> ``time``;
7. one extra, untimed call per algorithm inside a :func:`distrain.comm.core.ledger` records the
   payload bytes each rank sent (max over ranks, and the total); Gloo's native calls are
   invisible to the ledger, so native has no byte count.

All algorithms, native included, are called through :mod:`distrain.comm` (so the buffer
copies that wrapper makes, e.g. for all_gather/reduce_scatter, are paid by every algorithm).

``--transport torch,shm`` measures every algorithm on each transport, interleaved in the
same rounds: the world group carries the first transport, a second group of the same ranks
each further one. Columns are labelled ``ALGORITHM`` for torch and ``ALGORITHM@TRANSPORT``
otherwise (``native@shm`` = the direct shared-memory collectives, ``ring@shm`` = our ring
over shared-memory P2P).

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md): the size S is the bytes of the
full buffer: the tensor for all_reduce/broadcast/reduce; the gathered output (P*n elements)
for all_gather; the full input (P*n) for reduce_scatter; the full P*n buffer for
scatter/gather, where n (the ``count`` column) is the per-rank element count passed to the
call: S/elem for all_reduce/broadcast/reduce, S/(P*elem) rounded down otherwise (at least 1;
the reported size is the exact P*n*elem). ``algbw = S / time`` and ``busbw = algbw * factor``
with factor 2(P-1)/P for all_reduce, (P-1)/P for all_gather, reduce_scatter, scatter and
gather, 1 for broadcast and reduce. GB/s = 1e9 bytes/s. barrier has no size: time only.
Roots (src/dst) are rank 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any, Callable

import torch

from distrain.bench import common, comm_predict
from distrain.bench.comm_report import (  # noqa: F401  (re-exported: the conventions are part of this API)
    bandwidths, busbw_factor, format_markdown, format_tables, full_size, per_rank_count, plot)
from distrain.comm.api import ALGORITHM_NAMES, COLLECTIVES
from distrain.comm.core.transport import TRANSPORT_NAMES
from distrain.comm.core.ops import SUPPORTED_DTYPES
from distrain.errors import ConfigError

DEFAULT_NPROC = "2,4"
DEFAULT_OPS = "all_reduce"
DEFAULT_ALGORITHMS = ",".join(ALGORITHM_NAMES)
DEFAULT_SIZES = "4K,256K,4M,16M"
DEFAULT_TRANSPORTS = "torch"
TARGET_S = 0.5  # adaptive iterations: about this long per cell ...
MIN_ITERS, MAX_ITERS = 5, 50  # ... but at least / at most this many iterations
BURST_S, MAX_BURST = 2e-3, 200  # calls back to back per timed sample: about 2 ms, at most 200
ROOT = 0

_DTYPES = {str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES if d != torch.bool}


# ---------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Time the collectives of distrain.comm for every algorithm side by side and print "
                     "nccl-tests-style tables (time, algbw, busbw). See docs/benchmarks.md.")
    p.add_argument("--nproc", default=DEFAULT_NPROC,
                   help=f"world size(s), e.g. 4 or 2,4: one spawn each (default {DEFAULT_NPROC})")
    p.add_argument("--ops", default=DEFAULT_OPS,
                   help=f"collectives, comma-separated or 'all', from {', '.join(COLLECTIVES)} "
                        f"(default {DEFAULT_OPS}; barrier reports time only)")
    p.add_argument("--algorithms", default=DEFAULT_ALGORITHMS,
                   help=f"algorithms, comma-separated or 'all' (default {DEFAULT_ALGORITHMS})")
    p.add_argument("--transport", default=DEFAULT_TRANSPORTS,
                   help=f"transports to compare, comma-separated: {', '.join(TRANSPORT_NAMES)} (default torch)")
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"full-buffer sizes in bytes, K/M/G = powers of 1024 (default {DEFAULT_SIZES})")
    p.add_argument("--dtype", default="float32", help=f"element type, one of {', '.join(_DTYPES)} (default float32)")
    p.add_argument("--warmup", default="3", help="untimed rounds per (op, size) before timing (default 3)")
    p.add_argument("--iters", default=None,
                   help=f"timed rounds per (op, size); default adaptive: ceil({TARGET_S} s / slowest warm-up call) "
                        f"clamped to [{MIN_ITERS}, {MAX_ITERS}]")
    p.add_argument("--burst", default=None,
                   help=f"calls back to back per timed sample (time / calls); default adaptive: about "
                        f"{BURST_S * 1e3:g} ms, at most {MAX_BURST}; 1 = one call after each barrier")
    p.add_argument("--bind-cores", default="auto", choices=["auto", "on", "off"],
                   help="pin each rank to cores of its own (distrain.spawn's bind_cores); auto: when a measured "
                        "transport polls shared memory (shm, auto). Gloo is faster unbound with one core per rank")
    p.add_argument("--json", default=None, metavar="PATH", help="write every median and metadata as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a busbw-vs-size figure (PNG, matplotlib)")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the tables as Markdown (for docs)")
    p.add_argument("--predict", nargs="?", const="auto", default=None, metavar="CALIBRATION",
                   help="add the cost model's predicted_us to every record, with links from a `distrain bench link "
                        "--json` file, or (no value) from a short ping-pong at the start (docs/cost_model.md)")
    p.add_argument("--timeout", default="3600", help="seconds allowed for each world size's spawn (default 3600)")


def _int(text, flag: str, minimum: int) -> int:
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag}: expected an integer, got {text!r}") from None
    if v < minimum:
        raise ConfigError(f"{flag}: must be >= {minimum}, got {v}")
    return v


def parse_config(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every flag (ConfigError with a clear message) into a plain, picklable dict."""
    dtype = str(args.dtype).removeprefix("torch.")
    if dtype not in _DTYPES:
        raise ConfigError(f"--dtype: unknown or unsupported dtype {args.dtype!r}; use one of {', '.join(_DTYPES)}")
    try:
        timeout = float(args.timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"--timeout: expected seconds, got {args.timeout!r}") from None
    if not timeout > 0:
        raise ConfigError(f"--timeout: must be positive, got {args.timeout!r}")
    cfg = {
        "nprocs": common.parse_ints(args.nproc, "--nproc", minimum=1),
        "ops": common.parse_choices(args.ops, COLLECTIVES, "--ops"),
        "algorithms": common.parse_choices(args.algorithms, ALGORITHM_NAMES, "--algorithms"),
        "transports": common.parse_choices(getattr(args, "transport", DEFAULT_TRANSPORTS), TRANSPORT_NAMES,
                                           "--transport"),
        "sizes": common.parse_sizes(args.sizes),
        "dtype": dtype,
        "warmup": _int(args.warmup, "--warmup", 0),
        "iters": None if args.iters in (None, "", "auto") else _int(args.iters, "--iters", 1),
        "burst": None if getattr(args, "burst", None) in (None, "", "auto") else _int(args.burst, "--burst", 1),
        "timeout": timeout,
        "bind_cores": None,
        "target_s": TARGET_S,
        "predict": getattr(args, "predict", None),
    }
    bind = getattr(args, "bind_cores", "auto")
    cfg["bind_cores"] = (bind == "on") if bind != "auto" else any(t in ("shm", "auto") for t in cfg["transports"])
    if cfg["predict"] not in (None, "auto") and not os.path.isfile(cfg["predict"]):
        raise ConfigError(f"--predict: no calibration file {cfg['predict']!r}; write one with "
                          f"`distrain bench link --json {cfg['predict']}` or give --predict alone to calibrate now")
    if args.plot:
        common.require_pyplot()  # fail before the (long) measurement, not after
    return cfg


# ---------------------------------------------------------------------------------------
# One (op, size) case on one rank
# ---------------------------------------------------------------------------------------

def labels(algorithms: list[str], transports: list[str]) -> list[str]:
    """Column labels: the algorithm on torch, ``alg@transport`` on the others."""
    return [a if t == "torch" else f"{a}@{t}" for t in transports for a in algorithms]


def _split(label: str, groups: dict) -> tuple[str, Any]:
    alg, _, t = label.partition("@")
    return alg, groups[t or "torch"]


def _make_call(op: str, n: int, P: int, rank: int, dtype: torch.dtype, groups: dict) -> Callable[[str], None]:
    """Allocate op's buffers once; return call(label) doing one blocking collective."""
    from distrain import comm

    z = lambda k: torch.zeros(k, dtype=dtype)  # noqa: E731
    inner = _make_call_on(op, n, P, rank, z)

    def call(label: str) -> None:
        alg, group = _split(label, groups)
        inner(alg, group)

    return call


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


def _timed_round(call, algs: list[str], order_shift: int, dist, bursts: list[int]) -> list[float]:
    """One sample of every algorithm (order rotated by order_shift): after a barrier, ``bursts[k]``
    calls back to back; returns seconds per call for each algorithm."""
    A = len(algs)
    out = [0.0] * A
    for j in range(A):
        k = (j + order_shift) % A
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(bursts[k]):
            call(algs[k])
        out[k] = (time.perf_counter() - t0) / bursts[k]
    return out


def _choose(last: list[float] | None, cfg: dict, call, algs: list[str], dist) -> tuple[int, list[int]]:
    """Rounds and bursts, identical on every rank (from the slowest rank's warm-up calls)."""
    A = len(algs)
    if cfg["iters"] is not None and cfg["burst"] is not None:
        return cfg["iters"], [cfg["burst"]] * A
    if last is None:  # --warmup 0: one untimed probe round
        last = _timed_round(call, algs, 0, dist, [1] * A)
    probe = torch.tensor(last, dtype=torch.float64)
    dist.all_reduce(probe, op=dist.ReduceOp.MAX)
    t = probe.tolist()
    bursts = [cfg["burst"] or min(MAX_BURST, max(1, math.ceil(BURST_S / max(x, 1e-9)))) for x in t]
    round_s = max(sum(b * x for b, x in zip(bursts, t)) / A, 1e-9)  # per algorithm, like one call before
    iters = cfg["iters"] or common.adaptive_iters(round_s, cfg["target_s"], MIN_ITERS, MAX_ITERS)
    return iters, bursts


def _case(rank: int, P: int, op: str, size: int, cfg: dict, dist, groups: dict) -> list[dict]:
    from distrain import comm

    dtype = _DTYPES[cfg["dtype"]]
    elem = torch.tensor([], dtype=dtype).element_size()
    algs = labels(cfg["algorithms"], cfg["transports"])
    A = len(algs)
    n = per_rank_count(op, size, P, elem)
    S = full_size(op, n, P, elem)
    call = _make_call(op, n, P, rank, dtype, groups)

    last = None
    for w in range(cfg["warmup"]):
        last = _timed_round(call, algs, w, dist, [1] * A)
    iters, bursts = _choose(last, cfg, call, algs, dist)

    times = torch.zeros(A, iters, dtype=torch.float64)
    for i in range(iters):
        times[:, i] = torch.tensor(_timed_round(call, algs, i, dist, bursts), dtype=torch.float64)

    # Traffic: one extra untimed call per algorithm under a ledger.
    traffic = torch.zeros(A, 2, dtype=torch.int64)
    for k, a in enumerate(algs):
        dist.barrier()
        with comm.ledger() as led:
            call(a)
        traffic[k, 0] = led.bytes_sent(op, a.partition("@")[0])
        traffic[k, 1] = led.bytes_recv(op, a.partition("@")[0])

    all_times = [torch.empty_like(times) for _ in range(P)]
    dist.all_gather(all_times, times)
    all_traffic = [torch.empty_like(traffic) for _ in range(P)]
    dist.all_gather(all_traffic, traffic)

    records = []
    for k, a in enumerate(algs):
        per_rank = [t[k].tolist() for t in all_times]  # [rank][iteration]
        slowest = common.slowest_rank_times(per_rank)
        sec = common.median(slowest)
        algbw, busbw = bandwidths(op, S, P, sec)
        sent = [int(t[k, 0]) for t in all_traffic]
        recv = [int(t[k, 1]) for t in all_traffic]
        native = a.startswith("native")
        records.append({
            "P": P, "op": op, "algorithm": a, "dtype": cfg["dtype"], "transport": a.partition("@")[2] or "torch",
            "size_bytes": S, "requested_size_bytes": size if op != "barrier" else 0, "count": n,
            "iters": iters, "burst": bursts[k], "warmup": cfg["warmup"],
            "time_us": sec * 1e6, "algbw_GBps": algbw, "busbw_GBps": busbw,
            "busbw_factor": busbw_factor(op, P),
            "bytes_sent_max_rank": None if native else max(sent),
            "bytes_recv_max_rank": None if native else max(recv),
            "bytes_sent_total": None if native else sum(sent),
            "times_us": [t * 1e6 for t in slowest],  # per iteration, slowest rank
        })
    return records


def _worker(rank: int, cfg: dict) -> list[dict] | None:
    """Runs on every rank of one spawn; rank 0 returns the records."""
    import torch.distributed as dist

    from distrain import comm

    P = dist.get_world_size()
    groups: dict[str, Any] = {}
    for i, t in enumerate(cfg["transports"]):  # one group of all ranks per transport
        g = None if i == 0 else dist.new_group(list(range(P)))
        comm.set_transport(t, g)
        groups[t] = g
    records: list[dict] = []
    fabric = comm_predict.setup(cfg["predict"], rank) if cfg.get("predict") else None
    sizes = cfg["sizes"]
    t_start = time.perf_counter()
    for op in cfg["ops"]:
        for size in (sizes if op != "barrier" else [0]):
            t0 = time.perf_counter()
            recs = _case(rank, P, op, size, cfg, dist, groups)
            if fabric is not None:
                comm_predict.annotate(recs, fabric, torch.tensor([], dtype=_DTYPES[cfg["dtype"]]).element_size())
            records += recs
            if rank == 0:
                cells = "  ".join(f"{r['algorithm']} {r['time_us']:.0f}us" for r in recs)
                common.progress(f"[P={P}] {op} {common.format_size(size) if size else '-'}: iters={recs[0]['iters']}  "
                                f"{cells}  ({time.perf_counter() - t0:.1f}s, total {time.perf_counter() - t_start:.0f}s)")
    return records if rank == 0 else None


# ---------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------

def _bound(cfg: dict, P: int) -> bool:
    """Whether P ranks are bound to cores: as asked, and only with a core per rank (P=4 on 2 cores: not)."""
    return bool(cfg["bind_cores"]) and len(os.sched_getaffinity(0)) >= P


def measure(cfg: dict) -> list[dict]:
    """Run every world size of cfg (one spawn each) and return all records.

    Under a launcher (``distrain launch``, ``distrain cluster run``: RANK and WORLD_SIZE set)
    the launched world is measured instead; rank 0 returns the records, the others [].
    """
    import distrain

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        distrain.runtime.init(timeout=cfg["timeout"])
        try:
            return _worker(dist.get_rank(), cfg) or []
        finally:
            distrain.runtime.shutdown()

    records: list[dict] = []
    for P in cfg["nprocs"]:
        common.progress(f"[P={P}] spawning {P} ranks: ops {','.join(cfg['ops'])}; algorithms "
                        f"{','.join(cfg['algorithms'])}; sizes {','.join(map(common.format_size, cfg['sizes']))}")
        t0 = time.perf_counter()
        results = distrain.spawn(_worker, P, args=(cfg,), timeout=cfg["timeout"], bind_cores=_bound(cfg, P))
        records += results[0]
        common.progress(f"[P={P}] done in {time.perf_counter() - t0:.1f}s")
    return records


def command_line(args: argparse.Namespace) -> str:
    """The equivalent ``distrain bench comm ...`` command, every flag spelled out."""
    parts = ["distrain", "bench", "comm"]
    for flag in ("nproc", "ops", "algorithms", "transport", "sizes", "dtype", "warmup", "iters", "json", "plot",
                 "timeout", "predict"):
        v = getattr(args, flag, None)
        if v is not None:
            parts += [f"--{flag}", str(v)]
    return " ".join(parts)


def run(args: argparse.Namespace) -> int:
    cfg = parse_config(args)
    t0 = time.perf_counter()
    records = measure(cfg)
    elapsed = time.perf_counter() - t0
    if not records and "RANK" in os.environ:  # launched, not rank 0: rank 0 reports
        return 0
    columns = labels(cfg["algorithms"], cfg["transports"])
    print(format_tables(records, columns, cfg["dtype"]))
    if cfg["predict"]:
        print(comm_predict.table(records))
    sys.stdout.flush()
    if args.json:
        meta = common.metadata(command_line(args), benchmark="comm", nprocs=cfg["nprocs"], ops=cfg["ops"],
                               algorithms=cfg["algorithms"], transports=cfg["transports"], sizes=cfg["sizes"], dtype=cfg["dtype"],
                               warmup=cfg["warmup"], iters=cfg["iters"] if cfg["iters"] else
                               f"adaptive: ceil({TARGET_S}s / slowest warm-up call), clamped to [{MIN_ITERS}, {MAX_ITERS}]",
                               elapsed_s=round(elapsed, 1),
                               threads_per_rank={str(P): max(1, (os.cpu_count() or 1) // P) for P in cfg["nprocs"]},
                               bind_cores={str(P): _bound(cfg, P) for P in cfg["nprocs"]},
                               method="per sample: native barrier, then `burst` blocking calls back to back, "
                                      "perf_counter / burst; per iteration max over ranks; median over iterations; "
                                      "algorithms interleaved in rotated order per round")
        common.write_json(args.json, meta, records)
        common.progress(f"wrote {args.json}")
    if args.plot:
        plot(records, columns, args.plot)
        common.progress(f"wrote {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(records, columns) + "\n")
        common.progress(f"wrote {args.markdown}")
    common.progress(f"bench comm: {len(records)} records in {elapsed:.1f}s")
    return 0
