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
   warm-up call), clamped to [1, MAX_BURST], the same on every rank. A timed sample starts (the
   sample's start, ``--start``, :mod:`distrain.bench.comm.start`) and then makes ``burst``
   blocking calls back to back (``async_op=False``), timed on each rank with
   ``time.perf_counter`` from the start to its last call's return, divided by ``burst``:
   nccl-tests' and the OSU benchmarks' method (many calls in a row, time over count). The start
   (default ``window``, ReproMPI's window synchronisation) is a common instant: once per cell each
   rank's clock offset to rank 0 is estimated by ping-pong (NTP's formula, the shortest round trip),
   and before each sample rank 0 fixes ``now + margin`` and every rank waits for that instant on its
   corrected clock, so every rank starts together, as the cost model's schedules do. ``--start
   barrier`` starts each rank at its exit from a native barrier instead; ranks leave a barrier up
   to a link latency apart per round, which a slowest-rank time then holds. A lone call also
   times the wake-up of a rank that waited (hundreds of microseconds over Gloo), which hides a
   latency of a few microseconds; ``--burst 1`` gives that per-call method back. Bursts last about
   BURST_S, so at 1 MiB and above a burst is one call;
5. time ``iters`` rounds. In round i the algorithms run back to back in an order rotated
   by i (native, star, ring, tree; then star, ring, tree, native; ...) so that machine noise
   and cache state hit every algorithm alike;
6. gather every rank's per-iteration times (and starts) to every rank (a native all_gather of a
   float64 tensor); per iteration take the max over ranks (the slowest rank's time: a collective is
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
over shared-memory P2P). ``--symmetric`` adds a ``native@shm+sym`` column per shared-memory
transport: the same call on buffers cut from symmetric memory (``comm.symmetric_empty``), which
all_reduce reduces in place in every rank's copy (the others take their usual path on them).

Sizes and bandwidths follow nccl-tests (doc/PERFORMANCE.md): the size S is the bytes of the
full buffer: the tensor for all_reduce/broadcast/reduce; the gathered output (P*n elements)
for all_gather; the full input (P*n) for reduce_scatter; the full P*n buffer for
scatter/gather, where n (the ``count`` column) is the per-rank element count passed to the
call: S/elem for all_reduce/broadcast/reduce, S/(P*elem) rounded down otherwise (at least 1;
the reported size is the exact P*n*elem). ``algbw = S / time`` and ``busbw = algbw * factor``
with factor 2(P-1)/P for all_reduce, (P-1)/P for all_gather, reduce_scatter, scatter and
gather, 1 for broadcast and reduce. GB/s = 1e9 bytes/s. barrier has no size: time only.
Roots (src/dst) are rank 0.

``--background-load N`` starts N busy processes (:mod:`distrain.bench.background`) before the
first spawn and stops them after the last; every cell records the load average at its start
and end. The per-rank side (steps 1-7) lives in :mod:`distrain.bench.comm.timing`. The flags are
parsed and checked into the plain, picklable ``cfg`` dict :func:`run` and :func:`measure` take
by the command line (distrain/cli/bench_comm.py, ``comm_config``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from distrain.bench import background, common
from distrain.bench.comm import predict
from distrain.bench.comm.report import (  # noqa: F401  (re-exported: the conventions are part of this API)
    bandwidths, busbw_factor, format_markdown, format_tables, full_size, per_rank_count, plot)
from distrain.bench.comm.timing import (  # noqa: F401  (re-exported: the per-rank side, see timing.py)
    DTYPES, BURST_S, MAX_BURST, MAX_ITERS, MIN_ITERS, ROOT, TARGET_S, labels, run_rank, time_case)
from distrain.launch.cores import free_core_slices
from distrain.launch.local import default_threads


METHODS = {  # the JSON's meta "method", by --start
    "window": "per sample: every rank starts at a common instant rank 0 fixes ahead (all_reduce, then a broadcast "
              "of now + margin; each rank's clock offset to rank 0 by NTP-style ping-pong once per cell, the "
              "shortest round trip's), then `burst` blocking calls back to back, perf_counter from the common "
              "start / burst; per iteration max over ranks; median over iterations; algorithms interleaved in "
              "rotated order per round",
    "barrier": "per sample: native barrier, then `burst` blocking calls back to back, perf_counter / burst; per "
               "iteration max over ranks; median over iterations; algorithms interleaved in rotated order per round",
}


def _bound(cfg: dict, P: int) -> bool:
    """Whether P ranks are bound to cores: as asked, and only with a core per rank (P=4 on 2 cores: not);
    auto (None): when P cores are free now (the background load, if any, is already running)."""
    if cfg["bind_cores"] is None:
        return free_core_slices(P) is not None
    return bool(cfg["bind_cores"]) and len(os.sched_getaffinity(0)) >= P


def measure(cfg: dict) -> list[dict]:
    """Run every world size of cfg (one spawn each) and return all records.

    Under a launcher (``distrain launch``, ``distrain cluster run``: RANK and WORLD_SIZE set)
    the launched world is measured instead; rank 0 returns the records, the others [].
    """
    import distrain

    if distrain.runtime.launched_rank(os.environ) is not None:
        import torch.distributed as dist

        distrain.runtime.init(timeout=cfg["timeout"])
        try:
            return run_rank(dist.get_rank(), cfg) or []
        finally:
            distrain.runtime.shutdown()

    records: list[dict] = []
    for P in cfg["nprocs"]:
        common.progress(f"[P={P}] spawning {P} ranks: ops {','.join(cfg['ops'])}; algorithms "
                        f"{','.join(cfg['algorithms'])}; sizes {','.join(map(common.format_size, cfg['sizes']))}")
        t0 = time.perf_counter()
        bound = cfg.setdefault("bound", {})[str(P)] = _bound(cfg, P)  # decided once, recorded as decided
        results = distrain.spawn(run_rank, P, args=(cfg,), timeout=cfg["timeout"], bind_cores=bound)
        records += results[0]
        common.progress(f"[P={P}] done in {time.perf_counter() - t0:.1f}s")
    return records


def _load_windows(records: list[dict]) -> list[dict]:
    """One entry per measured cell (P, op, size): the load average at its start and end."""
    out: dict[tuple, dict] = {}
    for r in records:
        key = (r["P"], r["op"], r["size_bytes"])
        out.setdefault(key, background.window({"P": r["P"], "op": r["op"], "size_bytes": r["size_bytes"]},
                                              r.get("loadavg_start"), r.get("loadavg_end")))
    return list(out.values())


def run(cfg: dict[str, Any], json_path: str | None = None, plot_path: str | None = None,
        markdown_path: str | None = None, command: str | None = None) -> int:
    """Measure ``cfg`` (the flags as distrain/cli/bench_comm.py checks them: ``comm_config``), print the
    tables, and write the JSON (its metadata naming ``command``), the plot and the Markdown asked for."""
    # launched: one set of busy processes per host (local rank 0's); spawned: ours, around every spawn
    from distrain import runtime

    launched = runtime.launched_rank(os.environ)
    starts_load = launched is None or os.environ.get("LOCAL_RANK", str(launched[0])) == "0"
    t0 = time.perf_counter()
    with background.BackgroundLoad(cfg["background_load"] if starts_load else 0):
        records = measure(cfg)
        memcpy = round(common.memcpy_GBps(), 2) if records else None  # under the same load, right after
    elapsed = time.perf_counter() - t0
    if not records and launched is not None:  # launched, not rank 0: rank 0 reports
        return 0
    columns = labels(cfg["algorithms"], cfg["transports"], cfg["symmetric"])
    windows = _load_windows(records)
    print(format_tables(records, columns, cfg["dtype"]))
    print(background.summary(cfg["background_load"], windows))
    if memcpy is not None:
        print(f"# memcpy on this machine just after (64 MiB, one thread, median of 10): {memcpy:.1f} GB/s")
    if cfg["predict"]:
        print(predict.table(records))
    sys.stdout.flush()
    if json_path:
        meta = common.metadata(command, benchmark="comm", nprocs=cfg["nprocs"], ops=cfg["ops"],
                               algorithms=cfg["algorithms"], transports=cfg["transports"], sizes=cfg["sizes"], dtype=cfg["dtype"],
                               warmup=cfg["warmup"], iters=cfg["iters"] if cfg["iters"] else
                               f"adaptive: ceil({TARGET_S}s / slowest warm-up call), clamped to [{MIN_ITERS}, {MAX_ITERS}]",
                               elapsed_s=round(elapsed, 1), memcpy_GBps=memcpy,
                               threads_per_rank={str(P): default_threads(P) for P in cfg["nprocs"]},
                               bind_cores=cfg.get("bound") or {str(P): _bound(cfg, P) for P in cfg["nprocs"]},
                               start=cfg.get("start", "window"),
                               method=METHODS[cfg.get("start", "window")],
                               **background.meta(cfg["background_load"], windows))
        common.write_json(json_path, meta, records)
        common.progress(f"wrote {json_path}")
    if plot_path:
        plot(records, columns, plot_path)
        common.progress(f"wrote {plot_path}")
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(format_markdown(records, columns) + "\n")
        common.progress(f"wrote {markdown_path}")
    common.progress(f"bench comm: {len(records)} records in {elapsed:.1f}s")
    return 0
