"""Measured training step time (``distrain train`` run folders) beside ``distrain plan``'s prediction.

Usage (after ``distrain cluster run -- distrain train ... --out RUN`` on an emulated cluster,
one rank per node, and ``distrain bench link --json CAL`` on the same cluster)::

    distrain bench step-predict CAL.json LINK RUN [RUN ...] > table.md

For every run folder: the run's settings come from its ``config.json`` (model, strategy,
nproc, servers, batch size, algorithm); measured = the median of ``time_s`` over its
``metrics.jsonl`` steps after the first ``WARMUP`` (the first step includes start-up);
predicted = :func:`distrain.costmodel.plan.plan_ddp` or ``plan_ps`` on the calibrated links
with compute measured on this host *the way the emulated cluster computes*: its nodes share
this host's cores, so forward+backward (at the rank's own batch) and the AdamW step are
timed in as many concurrent processes as there are computing ranks (P for DDP, the W
workers for ps-sync), each with the threads ``distrain cluster run`` gives a rank
(``OMP_NUM_THREADS`` = cores // ranks), and the median over those processes is used.
"""

from __future__ import annotations

import json
from pathlib import Path

from distrain.bench import common
from distrain.errors import ConfigError

WARMUP = 2


def _compute(rank: int, model: str, local_batch: float) -> tuple[float, float]:
    from distrain.costmodel import plan

    return plan.measure_compute(model, local_batch, reps=5), plan.measure_optimizer(model)


def measured_compute(model: str, ranks: int, local_batch: float, threads: int):
    """A plan.Compute from ``ranks`` concurrent processes (median over them)."""
    import distrain
    from distrain.costmodel import plan

    got = distrain.spawn(_compute, ranks, args=(model, local_batch), timeout=600, threads_per_rank=threads)
    fb, opt = common.median([g[0] for g in got]), common.median([g[1] for g in got])
    return plan.Compute(lambda b: fb, opt)


def row(cal: str, link: str, run: Path, compute=measured_compute) -> list[str]:
    """One table row; ``compute(model, ranks, local_batch, threads)`` -> plan.Compute (measured by default)."""
    from distrain.cluster.runner import rank_threads
    from distrain.costmodel import plan
    from distrain.costmodel.links import block_placement, calibrated_fabric
    from distrain.trainer.metrics import read_metrics

    cfg = json.loads((run / "config.json").read_text())
    steps = [r["time_s"] for r in read_metrics(run / "metrics.jsonl")][WARMUP:]
    P, strategy = cfg["nproc"], cfg["strategy"]
    fabric = calibrated_fabric(cal, block_placement(P, 1))
    spec = plan.model_spec(cfg["model"], None)
    threads = rank_threads(P)
    if strategy == "ddp":
        c = compute(cfg["model"], P, cfg["batch_size"] / P, threads)
        p = plan.plan_ddp(spec, fabric, c, cfg["batch_size"], cfg["algorithm"])
        name = f"ddp {cfg['algorithm']}"
    elif strategy == "ps-sync":
        W = P - cfg["servers"]
        c = compute(cfg["model"], W, cfg["batch_size"] / W, threads)
        p = plan.plan_ps(spec, fabric, c, cfg["batch_size"], cfg["servers"])
        name = f"ps-sync S={cfg['servers']}"
    else:
        raise ConfigError(f"{run}: strategy {strategy!r} is not modelled here (ddp, ps-sync)")
    meas = common.median(steps)
    return [cfg["model"], name, link, str(P), f"{meas * 1e3:.0f}", f"{p.step_s * 1e3:.0f}",
            f"{p.compute_s * 1e3:.0f} + {(p.step_s - p.compute_s) * 1e3:.0f}",
            f"{100 * (p.step_s - meas) / meas:+.0f}%"]


def run(cal: str, link: str, runs: list[str]) -> int:
    """Prints the markdown table: one row per run folder (see the module's docstring)."""
    if not Path(cal).is_file():
        raise ConfigError(f"bench step-predict: no calibration file {cal}; write one with distrain bench link --json")
    for r in runs:
        missing = [f for f in ("config.json", "metrics.jsonl") if not (Path(r) / f).is_file()]
        if missing:
            raise ConfigError(f"bench step-predict: {r} is not a distrain train run folder (no {missing[0]}); "
                              f"give folders written by distrain train --out")
    head = ["model", "strategy", "link", "P", "measured ms", "predicted ms", "compute + exposed comm", "error"]
    rows = [row(cal, link, Path(r)) for r in runs]
    print(common.markdown_table(head, rows))
    return 0
