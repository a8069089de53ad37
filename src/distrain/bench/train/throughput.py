"""``distrain bench train``: data-parallel training throughput, side by side in one run.

    distrain bench train --nproc 1,2,4 --strategies ddp,torch-ddp,ps-sync,ps-async --model mlp

For each world size P and each strategy, one real training job (``distrain.trainer.train``)
of ``--warmup`` + ``--steps`` steps on the same model, data and *global* batch, so every job
does the same work per step; only the way the gradient is shared differs:

* ``single``: one process, the baseline (always run at P = 1);
* ``ddp``: our DistributedDataParallel (``--algorithm``, default ring);
* ``torch-ddp``: torch.nn.parallel.DistributedDataParallel, our peer;
* ``zero1`` / ``zero2`` / ``zero3``: our ZeRO engine (torch's FSDP2 beside them: ``bench zero``);
* ``ps-sync`` / ``ps-async``: our parameter server with ``--servers`` server ranks (the
  other P - S ranks are workers, so a PS job at P computes on fewer ranks);
* ``local``: the same P ranks with no gradient exchange (each steps its own replica): the
  floor of every data-parallel step at P. ``over local`` = 1 - local / step is the share of
  a strategy's step that communication and its bookkeeping cost, measured the same way for
  torch's DDP (whose own wait is invisible) as for ours; 1 / (1 - that share of torch-ddp)
  is the most any DDP can gain over torch's on this machine;
* ``single-threads``: one process that gives every usable core (``os.sched_getaffinity``) to
  torch's intra-op threads (``torch.set_num_threads(cores)``), the same model, global batch and
  steps: the answer to "is P ranks faster than one process on the same cores?". Like
  ``single`` it is one job whatever ``--nproc`` is, and it runs in every round with the others.

``--transport torch,shm`` runs each of our strategies once per transport (labelled
``ddp`` on torch, ``ddp@shm`` on shared memory); torch-ddp always runs on Gloo.

Reported per job (after the warm-up steps): the median step time of rank 0 (which waits
for the others, so it is the job's pace), samples or tokens per second, speedup over
``single``, scaling efficiency = speedup / P, the share of the step spent waiting on
communication (our DDP and PS report it; torch's DDP does not expose it), and the bytes
each rank sent and received per step according to its ledger (torch's DDP traffic is inside
Gloo and invisible to it). ``--rounds`` repeats everything with the strategy order rotated,
and the median over rounds is reported, so machine noise hits all strategies alike.

``--background-load N`` starts N busy processes (:mod:`distrain.bench.background`) before the
first job and stops them after the last; every job records the load average at its start and
end (the JSON's metadata), and the table's last line summarises it. ``--check-replicas N`` makes
ddp's jobs compare their replicas' bits every N steps (``distrain train --check-replicas``,
trainer/replicas.py): each such job adds a line under the table with the check's median time (hash
and all-gather, on rank 0) and its share of the step time, check / (N x step). The command line
(distrain/cli/bench.py) parses and checks the flags into :class:`Settings`, which :func:`run` takes.
"""

from __future__ import annotations

import os
import statistics
import tempfile
from dataclasses import dataclass

from distrain.bench import background
from distrain.bench.common import format_table, metadata, progress, write_json
from distrain.errors import ConfigError
from distrain.trainer.config import MODEL_DATA, TrainConfig, applicable
from distrain.trainer.metrics import read_metrics

STRATEGIES = ("ddp", "torch-ddp", "zero1", "zero2", "zero3", "ps-sync", "ps-async", "local", "single-threads")
ONE_PROCESS = ("single-threads",)  # one job at P = 1 whatever --nproc is, like the single baseline


@dataclass(frozen=True)
class Settings:
    """One ``bench train`` run, its flags parsed and checked (distrain/cli/bench.py)."""
    nprocs: list[int]  # world sizes
    strategies: list[str]  # of STRATEGIES
    model: str  # a MODEL_DATA preset
    steps: int  # timed steps per job
    warmup: int  # untimed steps per job
    batch_size: int | None  # global batch; None: 240 for MLPs, 24 for GPTs (divisible by 1-4 workers)
    algorithm: str  # all-reduce algorithm of our DDP
    transports: tuple[str, ...]  # of our strategies: torch, shm, auto
    bucket_cap_mb: float  # gradient bucket size of ddp and torch-ddp
    servers: int  # parameter-server ranks for ps-*
    max_staleness: int  # staleness bound for ps-async
    rounds: int  # repeats of the whole set, strategy order rotated
    background_load: int = 0  # busy processes beside the jobs (bench/background.py)
    check_replicas: int = 0  # ddp's jobs compare their replicas' bits every this many steps (0: off)
    json_path: str | None = None  # where every record goes


def _jobs(nprocs: list[int], strategies: list[str], servers: int,
          transports: tuple[str, ...] = ("torch",)) -> list[tuple[int, str, str]]:
    jobs = [(1, "single", "torch")]  # the baseline of speedup and efficiency, always measured
    jobs += [(1, s, "torch") for s in strategies if s in ONE_PROCESS]
    for P in nprocs:
        for s in strategies:
            if P == 1 or s in ONE_PROCESS or (s.startswith("ps-") and P < servers + 1):
                continue
            for t in (transports if s not in ("torch-ddp", "local") else ("torch",)):
                jobs.append((P, s, t))
    return jobs


def _label(strategy: str, transport: str) -> str:
    return strategy if transport == "torch" else f"{strategy}@{transport}"


def _config(P: int, strategy: str, transport: str, opts: Settings, batch: int, root: str) -> TrainConfig:
    s = "single" if strategy in ONE_PROCESS else strategy  # single-threads: single's job
    shared = applicable(s, algorithm=opts.algorithm, servers=opts.servers, bucket_cap_mb=opts.bucket_cap_mb,
                        max_staleness=opts.max_staleness)  # (what this strategy acts on)
    return TrainConfig(model=opts.model, data=MODEL_DATA[opts.model] if MODEL_DATA[opts.model] != "text" else "shakespeare",
                      strategy=s, nproc=P, transport=transport, **shared,
                      **({"check_replicas": opts.check_replicas} if s == "ddp" else {}),
                      steps=opts.warmup + opts.steps, batch_size=batch, eval_every=0, sample_chars=0,
                      progress=False, report=False, log_every=opts.warmup + opts.steps, overwrite=True,
                      out=os.path.join(root, f"{_label(strategy, transport)}-{P}"))


def _single_threads_rank(rank: int, cfg_dict: dict, cores: int) -> dict:
    import torch

    from distrain.trainer.loop import run_rank

    torch.set_num_threads(cores)  # spawn set it too (threads_per_rank); said here, where it matters
    return run_rank(TrainConfig.from_dict(cfg_dict))


def _train_single_threads(cfg: TrainConfig, cores: int) -> dict:
    """``train(cfg)`` for strategy single, but with ``cores`` torch threads in its one process."""
    from distrain import spawn
    from distrain.trainer.loop import BACKENDS
    from distrain.trainer.run_folder import check_out

    check_out(cfg)
    return spawn(_single_threads_rank, 1, args=(cfg.to_dict(), cores), backend=BACKENDS[cfg.device],
                 timeout=cfg.timeout or None, init_timeout=cfg.collective_timeout, threads_per_rank=cores,
                 bind_cores=False)[0]


def _measure(cfg: TrainConfig, opts: Settings, batch: int, strategy: str) -> dict:
    from distrain.trainer import train

    P, out = cfg.nproc, cfg.out
    threads = background.usable_cores() if strategy in ONE_PROCESS else None
    summary = _train_single_threads(cfg, threads) if threads else train(cfg)
    rows = [r for r in read_metrics(os.path.join(out, "metrics.jsonl")) if r["step"] >= opts.warmup]
    step_s = statistics.median(r["time_s"] for r in rows)
    units = next(k for k in rows[0] if k.endswith("_per_s")).removesuffix("_per_s")
    per_sample = rows[0][f"{units}_per_s"] * rows[0]["time_s"] / batch
    waits = [r["comm_wait_s"] / r["time_s"] for r in rows if r.get("comm_wait_s") is not None]
    traffic = summary["bytes_per_step"]
    checks = [r["replica_check_s"] for r in rows if "replica_check_s" in r]  # (--check-replicas: ddp's jobs)
    return {"nproc": P, "strategy": _label(strategy, cfg.transport), "transport": cfg.transport, "threads": threads,
            "step_ms": 1e3 * step_s, "unit": units,
            "throughput": batch * per_sample / step_s, "comm_share": statistics.median(waits) if waits else None,
            "bytes_sent_max_rank": max(t["sent"] for t in traffic), "bytes_recv_max_rank": max(t["recv"] for t in traffic),
            "bytes_per_rank": traffic, "final_loss": summary["final_loss"],
            # parameter servers: the ledger's data bytes against W*N_s per server (exact)
            "ps_bytes_match": summary.get("ps_bytes_match"), "ps_bytes": summary.get("ps_bytes"),
            "staleness_max": summary.get("staleness_max"),
            "replica_check_ms": 1e3 * statistics.median(checks) if checks else None,
            # the check's cost per step, every check_replicas steps, against the step's median time
            "replica_check_share": statistics.median(checks) / (opts.check_replicas * step_s) if checks else None}


def run(opts: Settings) -> int:
    """Run every job of ``opts`` (in rotated order, ``opts.rounds`` times), print the table, write the JSON."""
    if opts.model not in MODEL_DATA:
        raise ConfigError(f"--model {opts.model!r} is unknown; use one of {', '.join(MODEL_DATA)}")
    if opts.steps < 1 or opts.warmup < 0 or opts.rounds < 1:
        raise ConfigError("--steps and --rounds must be >= 1 and --warmup >= 0")
    if opts.check_replicas and "ddp" not in opts.strategies:
        raise ConfigError(f"--check-replicas {opts.check_replicas} times the replica check of ddp's jobs; add ddp to "
                          f"--strategies or drop --check-replicas")
    load = opts.background_load
    batch = opts.batch_size or (24 if MODEL_DATA[opts.model] == "text" else 240)
    transports = tuple(opts.transports)
    jobs = _jobs(opts.nprocs, opts.strategies, opts.servers, transports)
    results: dict[tuple[int, str, str], list[dict]] = {}
    windows: list[dict] = []  # every job's load average at its start and end
    with tempfile.TemporaryDirectory(prefix="distrain-bench-train-") as root:
        from distrain import runtime

        edge = runtime.validate_args()  # as train() will validate each
        configs = {j: _config(*j, opts, batch, root).validate(**edge) for j in jobs}  # all, before any runs
        with background.BackgroundLoad(load):
            for rnd in range(opts.rounds):
                k = rnd % len(jobs)
                for j in jobs[k:] + jobs[:k]:
                    progress(f"round {rnd + 1}/{opts.rounds}: {_label(j[1], j[2])} on {j[0]} process(es)")
                    start = background.loadavg()
                    results.setdefault(j, []).append(_measure(configs[j], opts, batch, j[1]))
                    windows.append(background.window({"round": rnd + 1, "nproc": j[0], "strategy": _label(j[1], j[2])},
                                                     start, background.loadavg()))
    records = [_median_record(v) for v in results.values()]
    base = next(r["throughput"] for r in records if r["strategy"] == "single")
    for r in records:
        r["speedup"] = r["throughput"] / base
        r["efficiency"] = r["speedup"] / r["nproc"]
        peer = next((q for q in records if q["nproc"] == r["nproc"] and q["strategy"] == "torch-ddp"), None)
        r["vs_torch_ddp"] = r["throughput"] / peer["throughput"] if peer else None
        floor = next((q for q in records if q["nproc"] == r["nproc"] and q["strategy"] == "local"), None)
        r["over_local"] = 1 - floor["step_ms"] / r["step_ms"] if floor and r is not floor else None
    print(_table(records, opts, batch))
    print(background.summary(load, windows))
    if opts.json_path:
        write_json(opts.json_path, metadata(model=opts.model, batch_size=batch, steps=opts.steps, warmup=opts.warmup,
                                       rounds=opts.rounds, algorithm=opts.algorithm, servers=opts.servers,
                                       check_replicas=opts.check_replicas,
                                       transports=list(transports),
                                       **background.meta(load, windows)), records)
    return 0


def _median_record(runs: list[dict]) -> dict:
    out = dict(runs[len(runs) // 2])
    for k in ("step_ms", "throughput") + (("replica_check_ms", "replica_check_share")
                                          if runs[0].get("replica_check_ms") is not None else ()):
        out[k] = statistics.median(r[k] for r in runs)
    out["rounds"] = len(runs)
    return out


def _table(records: list[dict], opts: Settings, batch: int) -> str:
    unit = records[0]["unit"]
    rows = []
    for r in sorted(records, key=lambda r: (r["nproc"], r["strategy"])):
        rows.append([str(r["nproc"]), r["strategy"], f"{r['step_ms']:.1f}", f"{r['throughput']:,.0f}",
                     f"{r['speedup']:.2f}", f"{r['efficiency']:.2f}",
                     f"{100 * r['comm_share']:.0f}%" if r["comm_share"] is not None else "n/a",
                     f"{100 * r['over_local']:.0f}%" if r["over_local"] is not None else "",
                     _sent(r, opts), f"{r['vs_torch_ddp']:.2f}" if r["vs_torch_ddp"] is not None else ""])
    head = f"{opts.model}, global batch {batch}, {opts.steps} timed steps after {opts.warmup} warm-up"
    checks = [f"\n{r['strategy']} on {r['nproc']}: replica check (hash + all-gather) {r['replica_check_ms']:.1f} ms, "
              f"{100 * r['replica_check_share']:.2f}% of the step time at --check-replicas {opts.check_replicas}"
              for r in sorted(records, key=lambda r: r["nproc"]) if r.get("replica_check_ms") is not None]
    return head + "\n" + format_table(
        [("", ["P", "strategy"]), ("step", ["ms", f"{unit}/s", "speedup", "effic."]),
         ("comm", ["wait", "over local", "MB sent/rank/step", "vs torch-ddp"])], rows) + "".join(checks)


def _sent(r: dict, opts: Settings) -> str:
    """The ledger's bytes; n/a where the traffic is not ours to count (Gloo's own collectives)."""
    ours_native = r["strategy"].startswith(("ddp", "zero")) and opts.algorithm == "native"
    invisible = r["strategy"] == "torch-ddp" or ours_native
    return "n/a" if invisible else f"{r['bytes_sent_max_rank'] / 1e6:.2f}"
