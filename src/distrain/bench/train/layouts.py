"""``distrain bench layouts``: every training layout on one model: samples/s and peak memory per rank.

    distrain bench layouts --model llama-small --nproc 2,4 --layouts ddp,zero3,tp2,pp2,dp2xtp2,tp2xpp2 --json F

The layouts and the jobs planned from them are in ``layout_plan.py``.
A layout is ``ddp``, ``zero1``/``zero2``/``zero3`` (ZeRO over all P ranks), or a grid
``dpAxcpDxtpBxppC`` (any of the parts, any order, e.g. ``tp2``, ``pp2``, ``cp2``, ``dp2xtp2``,
``tp2xpp2``; cp: context parallelism with ``--cp-algorithm`` ring or all-to-all), optionally
after a strategy (``zero1xpp2``: ZeRO over the grid's dp group).
A grid without ``dp`` fills the job with data parallelism, dp = P / (tp * pp), as
``distrain train --tp/--pp`` does, so ``tp2`` is dp1 x tp2 at P = 2 and dp2 x tp2 at P = 4.
A layout that does not fit P (tp * pp does not divide P; or dp * tp * pp != P with an
explicit dp) is skipped at that P with a note; two names that give the same grid at one P
(``tp2`` and ``dp2xtp2`` at P = 4) are measured once, under the first name. ``single``
(one process) always runs, at P = 1, as the baseline of the speedup.

Every job is a real training job of the trainer (the same ``TrainConfig`` as ``distrain
train --strategy S --nproc P --tp B --pp C --microbatches M``; fp32; the same model seed,
data seed and *global* batch): ``--warmup`` untimed steps, ``--steps`` timed steps, then
two memory steps. The ranks are spawned here with ``distrain.spawn`` and each calls
``distrain.trainer.loop.run_rank`` (what ``distrain.train`` runs in each rank) inside a
function of this module, which wraps the engine's ``train_step`` to measure memory without
changing the trainer. Reported per job:

* step time: rank 0's median over the timed steps (from the run's metrics.jsonl, as
  ``bench train``; rank 0 takes part in every step's collectives, so it is the job's pace),
  samples/s = global batch / step time, tokens/s = that x block size, speedup over single;
* peak memory per rank: the resident set size high-water mark (Linux VmHWM, reset through
  /proc/self/clear_refs just before the last memory step) minus the RSS of the rank before
  its model was built, max over ranks (each rank's value is kept too). That baseline is taken
  after importing the code every job imports on its way (the engines; torch._dynamo, which
  torch.optim's constructors import and which brings sympy, ~80 MB; tensorboard), so the
  peak counts the job's data rather than loaded code. For the memory steps glibc is set
  (mallopt M_MMAP_THRESHOLD = 64 KiB, then malloc_trim) to unmap freed blocks, so the peak
  follows live tensors (parameters, gradients, optimizer state, activations, comm
  buffers) rather than what the allocator keeps cached; the first memory step settles the
  allocator, the second is measured. This is done after the timed steps and not during them
  because fresh mappings fault their pages in on every step, which slowed sharded runs 2-4x
  in ``bench zero``. The peak also holds one-time state built during the steps (Gloo
  buffers, autograd and library caches), alike for every layout;
* the ledger's bytes sent per step (max over ranks; Gloo-native traffic is not counted) and
  the last step's loss (the same data and seed: every layout should land close to single).

Each rank runs ``--threads`` torch threads (default: spawn's cpu_count // P, as ``distrain
train``; so single runs 2 threads on 2 cores: on a loaded machine such a process can step
several times slower than with 1 thread, which inflates every speedup over it; compare with
``--threads 1``). ``--transport torch|shm|auto`` (default torch: Gloo) is every job's
``TrainConfig.transport`` (``distrain train --transport``); ranks polling shared memory may be
bound to free cores, as ``distrain train`` does. ``--rounds`` repeats every job with the order
rotated; medians over rounds are reported.
The machine's load average (``os.getloadavg``) is recorded at the start and the end. The
command line (distrain/cli/bench.py) parses the flags into :class:`Settings`, which :func:`run` takes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import tempfile
from dataclasses import dataclass

from distrain.bench.common import format_table, metadata, progress, unmap_freed_blocks, write_json
from distrain.bench.train.layout_plan import Job, Layout, parse_layout, parse_layouts, plan_jobs  # noqa: F401 (API)
from distrain.errors import ConfigError
from distrain.trainer.config import MODEL_DATA, TrainConfig, applicable
from distrain.trainer.metrics import read_metrics

MMAP_THRESHOLD = 64 * 1024  # bytes: glibc M_MMAP_THRESHOLD during the memory steps
MEMORY_STEPS = 2  # after the timed steps: one to settle the allocator, one measured
TRANSPORTS = ("torch", "shm", "auto")  # --transport: how every job's ranks exchange bytes (TrainConfig.transport)
INVARIANT_MODES = ("off", "on", "both")  # --layout-invariant: which jobs train with it


@dataclass(frozen=True)
class Settings:
    """One ``bench layouts`` run (distrain/cli/bench.py parses the flags; :func:`run` checks them)."""
    model: str  # a text preset: gpt-tiny, gpt-small, llama-tiny, llama-small
    nprocs: list[int]  # world sizes (single at P=1 always runs)
    layouts: str  # comma-separated: ddp, zero1-3, or dpAxtpBxppC grids (layout_plan.parse_layouts)
    batch_size: int  # global batch of sequences (same for every job)
    microbatches: int  # micro-batches per step of layouts with pp > 1
    schedule: str  # pipeline schedule of layouts with pp > 1 (gpipe, 1f1b, zb-h1)
    algorithm: str  # collective algorithm of our DDP, ZeRO, TP and PP
    steps: int  # timed steps per job
    warmup: int  # untimed steps per job, before the timed ones
    seed: int  # model and data seed (the same for every job)
    rounds: int  # repeats of every job, order rotated; medians over rounds
    transport: str  # of TRANSPORTS
    threads: int  # torch threads per rank (0: spawn's default, cpu_count // P)
    timeout: float  # seconds one job may take
    json_path: str | None = None  # where every record goes
    cp_algorithm: str = "ring"  # attention of layouts with cp > 1: ring or all-to-all
    invariant: str = "off"  # --layout-invariant: off, on (every job with it), both (each job without and with it)
    units: int = 0  # --units of the invariant jobs (0: the trainer's default)


def _config(job: Job, opts: Settings, root: str) -> TrainConfig:
    pp = job.pp > 1
    return TrainConfig(model=opts.model, data="shakespeare", strategy=job.strategy, nproc=job.nproc, device="cpu",
                       **applicable(job.strategy, algorithm=opts.algorithm), transport=opts.transport, tp=job.tp,
                       pp=job.pp, cp=job.cp, **({"cp_algorithm": opts.cp_algorithm} if job.cp > 1 else {}),
                       **({"ep": job.ep} if job.ep > 1 else {}),
                       microbatches=opts.microbatches if pp else 1, schedule=opts.schedule,
                       steps=opts.warmup + opts.steps + MEMORY_STEPS, batch_size=opts.batch_size, seed=opts.seed,
                       dtype="float32", eval_every=0, sample_chars=0, progress=False, report=False,
                       log_every=opts.warmup + opts.steps + MEMORY_STEPS, overwrite=True,
                       layout_invariant=job.invariant, units=opts.units if job.invariant else 0,
                       invariant_tp=job.invariant and job.tp > 1,  # (tp layouts: the canonical chunks)
                       out=os.path.join(root, f"{job.layout}-{job.nproc}" + ("-invariant" if job.invariant else "")))


def _validated(job: Job, opts: Settings, root: str) -> TrainConfig:
    """The job's TrainConfig, checked by the trainer's own validation; its error names the layout and P."""
    try:
        from distrain import runtime

        return _config(job, opts, root).validate(**runtime.validate_args())  # as train() will
    except ConfigError as e:
        raise ConfigError(f"--layouts {job.layout} at P={job.nproc} ({job.grid}, --strategy {job.strategy}): {e}") from None


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {key}")


def _preload() -> None:
    """Import what every job imports on its way (the trainer and its engines; torch._dynamo, with
    sympy ~80 MB, which torch.optim's constructors import; tensorboard, rank 0's metrics log)
    so that the RSS baseline holds that code and the peak counts a job's data, not its imports."""
    import importlib

    import torch._dynamo  # noqa: F401

    from distrain.trainer.engines import ENGINES

    for spec in set(ENGINES.values()):
        importlib.import_module(spec.split(":")[0])
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:  # the trainer logs without it
        pass


def _rank(rank: int, cfg_dict: dict, timed_steps: int) -> dict:
    """One rank: run_rank(cfg) as distrain.train's ranks do, each engine step inside a probe, so
    that the memory steps after the first ``timed_steps`` steps measure the RSS peak."""
    from distrain.trainer import loop

    _preload()
    base = _status_bytes("VmRSS")  # before the model is built, after the code every job loads
    cfg = TrainConfig.from_dict(cfg_dict)
    seen = {"calls": 0, "peak": None}

    @contextlib.contextmanager
    def probe():
        """Around each train_step: the memory steps after the first ``timed_steps`` measure the RSS peak."""
        i = seen["calls"]
        if i == timed_steps:  # first memory step: from now on glibc unmaps freed blocks
            unmap_freed_blocks(MMAP_THRESHOLD)
        if i == timed_steps + 1:  # the measured step: high-water mark := RSS now
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        yield
        if i == timed_steps + 1:
            seen["peak"] = _status_bytes("VmHWM") - base
        seen["calls"] = i + 1

    summary = loop.run_rank(cfg, step_probe=probe)
    if seen["peak"] is None:
        raise RuntimeError(f"rank {rank}: the engine ran {seen['calls']} train_step calls, fewer than the "
                           f"{timed_steps + MEMORY_STEPS} planned; no memory step was measured")
    return {"rank": rank, "peak": seen["peak"], "base": base, "summary": summary}


def _measure(job: Job, cfg: TrainConfig, opts: Settings) -> dict:
    import distrain
    from distrain.trainer import loop, run_folder

    run_folder.check_out(cfg)
    per_rank = distrain.spawn(_rank, cfg.nproc, args=(cfg.to_dict(), opts.warmup + opts.steps),
                              backend=loop.BACKENDS[cfg.device], timeout=opts.timeout,
                              init_timeout=cfg.collective_timeout,
                              bind_cores=None if cfg.transport in ("shm", "auto") else False,  # as distrain train
                              threads_per_rank=opts.threads or None)
    summary = per_rank[0]["summary"]
    rows = [r for r in read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
            if opts.warmup <= r["step"] < opts.warmup + opts.steps]
    step_s = statistics.median(r["time_s"] for r in rows)
    block = next(r["tokens_per_s"] * r["time_s"] for r in rows) / opts.batch_size  # tokens per sample
    peaks = [r["peak"] for r in per_rank]
    return {"nproc": job.nproc, "layout": job.layout, "aliases": list(job.aliases), "strategy": job.strategy,
            "layout_invariant": job.invariant, **({"units": cfg.units} if job.invariant else {}),
            "transport": cfg.transport, "dp": job.dp, "tp": job.tp, "pp": job.pp, "cp": job.cp, "ep": job.ep,
            **({"cp_algorithm": cfg.cp_algorithm} if job.cp > 1 else {}), "grid": job.grid,
            "microbatches": cfg.microbatches,
            "threads_per_rank": opts.threads or max(1, (os.cpu_count() or 1) // job.nproc),
            "step_ms": 1e3 * step_s, "samples_per_s": opts.batch_size / step_s,
            "tokens_per_s": opts.batch_size * round(block) / step_s,
            "peak_mem_bytes": max(peaks), "peak_mem_bytes_per_rank": peaks,
            "rss_before_model_bytes_per_rank": [r["base"] for r in per_rank],
            "bytes_sent_per_step_max_rank": max(t["sent"] for t in summary["bytes_per_step"]),
            "final_loss": summary["final_loss"], "step_ms_timed": [1e3 * r["time_s"] for r in rows]}


def _median_record(runs: list[dict]) -> dict:
    """Medians over rounds of step time and peak; the rates follow from the median step time."""
    out = dict(runs[len(runs) // 2])
    for k in ("step_ms", "samples_per_s", "tokens_per_s", "peak_mem_bytes"):
        out[f"{k}_rounds"] = [r[k] for r in runs]
    for k in ("step_ms", "peak_mem_bytes"):
        out[k] = statistics.median(r[k] for r in runs)
    per_sample = runs[0]["tokens_per_s"] / runs[0]["samples_per_s"]  # tokens per sample (block size)
    out["samples_per_s"] = runs[0]["samples_per_s"] * runs[0]["step_ms"] / out["step_ms"]  # = batch / step
    out["tokens_per_s"] = per_sample * out["samples_per_s"]
    out["rounds"] = len(runs)
    return out


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run(opts: Settings) -> int:
    """Run every job of ``opts`` (in rotated order, ``opts.rounds`` times), print the table, write the JSON."""
    if MODEL_DATA.get(opts.model) != "text":
        text = ", ".join(m for m, d in MODEL_DATA.items() if d == "text")
        raise ConfigError(f"--model {opts.model!r}: bench layouts trains a text preset ({text})")
    if opts.steps < 1 or opts.warmup < 0 or opts.rounds < 1 or opts.threads < 0:
        raise ConfigError("--steps and --rounds must be >= 1, --warmup and --threads >= 0")
    if opts.transport not in TRANSPORTS:
        raise ConfigError(f"--transport {opts.transport!r}: choose one of {', '.join(TRANSPORTS)}")
    if opts.invariant not in INVARIANT_MODES:
        raise ConfigError(f"--layout-invariant {opts.invariant!r}: choose one of {', '.join(INVARIANT_MODES)}")
    nprocs = opts.nprocs
    jobs, notes = plan_jobs(nprocs, parse_layouts(opts.layouts))
    if opts.invariant != "off":  # each job with the flag (after its default twin, when both: rounds alternate them)
        twin = [dataclasses.replace(j, invariant=True) for j in jobs]
        jobs = twin if opts.invariant == "on" else [j for pair in zip(jobs, twin) for j in pair]
    load_start = _load()
    progress(f"load average at start (1, 5, 15 min): {load_start}")
    for n in notes:
        progress(f"note: {n}")
    if len(jobs) == 1:
        progress("note: no layout fits any --nproc; only the single baseline runs")
    results: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="distrain-bench-layouts-") as root:
        configs = [_validated(j, opts, root) for j in jobs]  # every error before any run
        order = list(range(len(jobs)))
        for rnd in range(opts.rounds):
            k = rnd % len(order)
            for i in order[k:] + order[:k]:
                j = jobs[i]
                progress(f"round {rnd + 1}/{opts.rounds}: {j.layout} ({j.grid}, {j.strategy}) on {j.nproc} process(es)")
                results.setdefault(j.key, []).append(_measure(j, configs[i], opts))
    load_end = _load()
    records = [_median_record(results[j.key]) for j in jobs]
    base = records[0]["samples_per_s"]
    for r in records:
        r["speedup"] = r["samples_per_s"] / base
        r["efficiency"] = r["speedup"] / r["nproc"]
    if opts.invariant == "both":  # the cost of the flag: each invariant job over its default twin, same rounds
        for default, inv in zip(records[::2], records[1::2]):
            inv["step_ratio_vs_default"] = inv["step_ms"] / default["step_ms"]
            inv["peak_ratio_vs_default"] = inv["peak_mem_bytes"] / default["peak_mem_bytes"]
            inv["step_ratio_rounds"] = [a / b for a, b in zip(inv["step_ms_rounds"], default["step_ms_rounds"])]
    print(_table(records, opts, notes, load_start, load_end))
    if opts.json_path:
        write_json(opts.json_path, metadata(model=opts.model, batch_size=opts.batch_size, microbatches=opts.microbatches,
                                       schedule=opts.schedule, algorithm=opts.algorithm,
                                       cp_algorithm=opts.cp_algorithm,
                                       transport=opts.transport, steps=opts.steps,
                                       warmup=opts.warmup, memory_steps=MEMORY_STEPS, rounds=opts.rounds,
                                       seed=opts.seed, dtype="float32", layouts=opts.layouts, nprocs=nprocs,
                                       layout_invariant=opts.invariant, units=opts.units,
                                       threads_per_rank=opts.threads or "cpu_count // P",
                                       mmap_threshold=MMAP_THRESHOLD, notes=notes,
                                       load_avg_start=load_start, load_avg_end=load_end), records)
    return 0


def table_rows(records: list[dict]) -> list[list[str]]:
    mb = 1e6
    rows = []
    for r in records:
        name = r["layout"] + (f" (={','.join(r['aliases'])})" if r["aliases"] else "")
        if r.get("layout_invariant"):
            name += " invariant" + (f" ({r['step_ratio_vs_default']:.2f}x step, {r['peak_ratio_vs_default']:.2f}x peak)"
                                    if "step_ratio_vs_default" in r else "")
        rows.append([str(r["nproc"]), name, r["grid"], f"{r['step_ms']:.0f}", f"{r['samples_per_s']:.1f}",
                     f"{r['tokens_per_s']:,.0f}", f"{r['speedup']:.2f}", f"{r['peak_mem_bytes'] / mb:.1f}",
                     "/".join(f"{b / mb:.0f}" for b in r["peak_mem_bytes_per_rank"]),
                     f"{r['bytes_sent_per_step_max_rank'] / mb:.2f}", f"{r['final_loss']:.4f}"])
    return rows


HEADERS = [("", ["P", "layout", "grid"]), ("step", ["ms", "samples/s", "tokens/s", "speedup"]),
           ("peak RSS MB", ["max rank", "per rank"]), ("", ["MB sent/rank/step", "last loss"])]


def _table(records: list[dict], opts: Settings, notes: list[str], load_start, load_end) -> str:
    head = (f"{opts.model}, fp32 AdamW, global batch {opts.batch_size}, transport {opts.transport}, {opts.steps} timed "
            f"steps after {opts.warmup} warm-up, medians over {opts.rounds} round(s), "
            f"{opts.threads or 'cpu_count // P'} torch thread(s) per rank; pipelines: {opts.microbatches} "
            f"micro-batches, {opts.schedule}; peak RSS above the RSS before the model, MB = 1e6 bytes\n"
            f"load average (1, 5, 15 min) at start {load_start}, at end {load_end}, on {os.cpu_count()} CPUs")
    text = head + "\n" + format_table(HEADERS, table_rows(records))
    return text + "".join(f"\nnote: {n}" for n in notes)
