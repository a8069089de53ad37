"""The training loop: build topology, data, model, parallelize, optimizer; train; report.

``train(cfg)`` validates the config, then either runs this process as one rank (when a
launcher such as ``distrain launch``/torchrun set RANK and WORLD_SIZE) or spawns
``cfg.nproc`` local ranks. Each rank runs :func:`run_rank`, which reads top to bottom.

Determinism: the model is initialised from ``cfg.seed`` on every rank (and DDP broadcasts
rank 0's weights anyway); the batch of step s is a pure function of (seed, s) through
DistributedBatchSampler, whatever the number of ranks; so a run resumed from a checkpoint
at step k computes exactly the losses of an uninterrupted run from step k on.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm, runtime
from distrain.data import DistributedBatchSampler, decode, encode, load_digits, load_fashion_mnist, load_text_datasets
from distrain.errors import ConfigError
from distrain.launch import spawn
from distrain.models import build_model, classification_loss, generate, lm_loss
from distrain.trainer import checkpoint
from distrain.trainer.config import TrainConfig
from distrain.trainer.metrics import MetricsLog, format_table, plot_losses

CKPT_NAME = "checkpoint.pt"


def train(cfg: TrainConfig) -> dict:
    """Run a training job described by ``cfg``; returns rank 0's summary."""
    cfg.validate()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher: we are one rank
        runtime.init(timeout=cfg.collective_timeout)
        if dist.get_world_size() != cfg.nproc:
            raise ConfigError(f"the launcher started {dist.get_world_size()} ranks but --nproc is {cfg.nproc}")
        return run_rank(cfg)
    return spawn(_spawned, cfg.nproc, args=(cfg.to_dict(),), timeout=cfg.timeout or None,
                 init_timeout=cfg.collective_timeout)[0]


def _spawned(rank: int, cfg_dict: dict) -> dict:
    return run_rank(TrainConfig.from_dict(cfg_dict))


@dataclass
class Task:
    """What the loop needs to know about the data: batches, loss, and what a sample counts."""

    train: object
    val: object
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    unit: str  # "tokens" or "samples"
    units_per_sample: int
    dtype: torch.dtype

    def batch(self, ds, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = ds.get_batch(idx)
        return (x.to(self.dtype) if x.is_floating_point() else x), y


def build_task(cfg: TrainConfig, block_size: int | None) -> Task:
    dtype = getattr(torch, cfg.dtype)
    if cfg.data_kind == "text":
        train, val = load_text_datasets(None if cfg.data == "shakespeare" else cfg.data, block_size=block_size)
        return Task(train, val, lm_loss, "tokens", block_size, dtype)
    train, val = load_fashion_mnist() if cfg.data == "fashion-mnist" else load_digits()
    return Task(train, val, classification_loss, "samples", 1, dtype)


def build_optimizer(cfg: TrainConfig, params) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, cfg: TrainConfig) -> float:
    """Mean loss over the first ``eval_batches`` validation batches (the same every time)."""
    was = model.training
    model.eval()
    n = len(task.val)
    losses = []
    for b in range(cfg.eval_batches):
        idx = torch.arange(b * cfg.batch_size, (b + 1) * cfg.batch_size) % n
        x, y = task.batch(task.val, idx)
        losses.append(task.loss_fn(model(x), y).item())
    model.train(was)
    return sum(losses) / len(losses)


def run_rank(cfg: TrainConfig) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(cfg.out)
    is_logger = rank == 0
    if cfg.strategy.startswith("ps-"):
        from distrain.trainer.ps_loop import run_ps_rank

        return run_ps_rank(cfg)
    if cfg.model_parallel or cfg.dp:
        from distrain.trainer.mp_loop import run_mp_rank

        return run_mp_rank(cfg)

    # build model (same seed on every rank; DDP also broadcasts rank 0's weights)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(getattr(torch, cfg.dtype))
    base = model

    # build data: every rank reads the same global batch of step s and takes its slice
    task = build_task(cfg, getattr(getattr(model, "config", None), "block_size", None))
    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, dp_rank=rank, dp_size=world, seed=cfg.seed)

    # parallelize: data parallel over all ranks
    if cfg.strategy == "ddp":
        from distrain.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, algorithm=cfg.algorithm, bucket_cap_mb=cfg.bucket_cap_mb,
                                        compression=cfg.compression)
    elif cfg.strategy == "torch-ddp":
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_cap_mb)

    # build optimizer
    opt = build_optimizer(cfg, model.parameters())

    # resume
    start = 0
    if cfg.resume:
        state = checkpoint.load(out / CKPT_NAME)
        base.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = int(state["step"])
        if start > cfg.steps:
            raise ConfigError(f"checkpoint {out / CKPT_NAME} is at step {start}, past --steps {cfg.steps}")
    log = MetricsLog(out / "metrics.jsonl", start) if is_logger else None

    # train
    bar = _progress(cfg, start, is_logger)
    pending: list[dict] = []  # step records whose global loss is not averaged yet
    t_run = time.perf_counter()
    with comm.ledger() as led:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            x, y = task.batch(task.train, sampler.batch(step))
            opt.zero_grad(set_to_none=True)
            loss = task.loss_fn(model(x), y)
            loss.backward()
            opt.step()
            dt = time.perf_counter() - t0
            wait = getattr(model, "comm_wait_s", None)
            pending.append(step_record(step, loss, dt, wait, task, cfg))
            last = step == cfg.steps - 1
            do_eval = cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or last)
            do_ckpt = (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or last
            if do_eval and is_logger:  # only rank 0 evaluates; the others go on to the flush below
                pending[-1]["val_loss"] = evaluate(base, task, cfg)
                if bar is not None:
                    bar.write(f"step {step + 1}: validation loss {pending[-1]['val_loss']:.4f}")
            if len(pending) >= cfg.log_every or do_eval or do_ckpt:
                _flush(pending, log, bar)
                pending = []
            if do_ckpt and is_logger:
                checkpoint.save(out / CKPT_NAME, {"model": base.state_dict(), "optimizer": opt.state_dict(),
                                                  "step": step + 1, "config": cfg.to_dict()})
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    traffic = rank_traffic(led, cfg.steps - start)
    return _finish(cfg, rank, base, task, out, wall, start, traffic) if is_logger else {}


def step_record(step: int, loss: torch.Tensor | None, dt: float, comm_wait: float | None, task: Task,
                cfg: TrainConfig) -> dict:
    """One metrics.jsonl line; ``loss`` stays a tensor until _flush averages it over ranks
    (None on ranks that compute no loss, which then contribute 0)."""
    return {"step": step, "loss": (loss.detach() if loss is not None else torch.zeros(())).double(),
            "time_s": dt, "comm_wait_s": comm_wait,
            f"{task.unit}_per_s": cfg.batch_size * task.units_per_sample / dt}


def _progress(cfg: TrainConfig, start: int, on: bool):
    if not (on and cfg.progress):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=cfg.steps, initial=start, desc=f"{cfg.strategy}/{cfg.model}", dynamic_ncols=True)


def _flush(pending: list[dict], log: MetricsLog | None, bar, group=None, weight: float | None = None) -> None:
    """Average the pending steps' losses over the data-parallel ranks (one small all-reduce).

    With ``weight``, each rank contributes loss * weight to a sum instead (model parallelism:
    only some ranks hold the loss)."""
    losses = torch.stack([r["loss"] for r in pending])
    if weight is None:
        comm.all_reduce(losses, op="avg", group=group, algorithm="native")
    else:
        losses.mul_(weight)
        comm.all_reduce(losses, op="sum", group=group, algorithm="native")
    for r, v in zip(pending, losses.tolist()):
        r["loss"] = v
    if log is not None:
        log.write(pending)
    if bar is not None:
        r = pending[-1]
        rate = next(v for k, v in r.items() if k.endswith("_per_s"))
        post = {"loss": f"{r['loss']:.4f}", next(k for k in r if k.endswith("_per_s")).replace("_per_s", "/s"): f"{rate:,.0f}"}
        if r.get("comm_wait_s") is not None:
            post["comm"] = f"{100 * r['comm_wait_s'] / r['time_s']:.0f}%"
        bar.set_postfix(post)
        bar.update(len(pending))


def rank_traffic(led: comm.Ledger, steps: int) -> list[dict]:
    """Every rank's bytes sent and received per step (from its ledger), gathered on all ranks."""
    t = led.total()
    mine = torch.tensor([t.bytes_sent / max(1, steps), t.bytes_recv / max(1, steps)], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return [{"rank": r, "sent": row[0].item(), "recv": row[1].item()} for r, row in enumerate(rows)]


def _finish(cfg: TrainConfig, rank: int, model: nn.Module, task: Task, out: Path, wall: float, start: int,
            traffic: list[dict], extra: dict | None = None, can_sample: bool = True) -> dict:
    from distrain.trainer.metrics import read_metrics

    rows = read_metrics(out / "metrics.jsonl")
    run = [r for r in rows if r["step"] >= start]
    steady = run[min(len(run) - 1, 5):]  # skip warm-up steps for rates
    rate_key = f"{task.unit}_per_s"
    rate = sum(cfg.batch_size * task.units_per_sample for _ in steady) / max(1e-9, sum(r["time_s"] for r in steady))
    waits = [r["comm_wait_s"] for r in steady if r.get("comm_wait_s") is not None]
    comm_share = sum(waits) / sum(r["time_s"] for r in steady) if waits else None
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    summary = {
        "strategy": cfg.strategy, "model": cfg.model, "data": cfg.data, "nproc": cfg.nproc,
        "algorithm": cfg.algorithm if cfg.strategy == "ddp" else None, "steps": cfg.steps,
        "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
        rate_key: rate, "comm_share": comm_share, "bytes_per_step": traffic,
        "bytes_sent_per_step_rank0": traffic[0]["sent"], "wall_s": wall, **(extra or {}),
    }
    plot_losses(out / "metrics.jsonl", out / "loss.png", f"{cfg.model} on {cfg.data}, {cfg.strategy}, {cfg.nproc} proc")
    if task.unit == "tokens" and cfg.sample_chars > 0 and can_sample:
        g = torch.Generator().manual_seed(cfg.seed)
        ids = generate(model, encode("\n").unsqueeze(0), cfg.sample_chars, temperature=0.8, top_k=40, generator=g)
        summary["sample"] = decode(ids[0])
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    rows_out = [("strategy", f"{cfg.strategy}" + (f" ({cfg.algorithm})" if cfg.strategy == "ddp" else "")
                             + (f", dp={cfg.dp_size} tp={cfg.tp} pp={cfg.pp}" if cfg.model_parallel else "")
                             + (f", {cfg.microbatches} micro-batches ({cfg.schedule})" if cfg.pp > 1 else "")),
                ("model / data", f"{cfg.model} / {cfg.data}"), ("processes", str(cfg.nproc)),
                ("steps", f"{start} -> {cfg.steps}"), ("loss", f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}")]
    if vals:
        rows_out.append(("validation loss", f"{vals[-1]:.4f}"))
    rows_out += [(rate_key.replace("_", " "), f"{rate:,.0f}"),
                 ("communication wait", f"{100 * comm_share:.1f}% of step" if comm_share is not None else "n/a"),
                 ("bytes sent per step (rank 0)", f"{traffic[0]['sent']:,.0f}"),
                 *([("bytes per step, busiest rank", f"{max(t['sent'] for t in traffic):,.0f} sent, "
                                                      f"{max(t['recv'] for t in traffic):,.0f} received")]
                   if len(traffic) > 1 else []),
                 *([("max staleness seen", str(summary["staleness_max"])),
                    ("PS bytes = W*N_s fan-in/out", "exact" if summary["ps_bytes_match"] else "MISMATCH")]
                   if "staleness_max" in summary else []),
                 ("wall time", f"{wall:.1f} s"),
                 ("outputs", f"{out}/metrics.jsonl, loss.png, summary.json, {CKPT_NAME}")]
    if cfg.report:
        print("\n" + format_table(rows_out))
        if "sample" in summary:
            print("\n--- sample ---\n" + summary["sample"] + "\n--------------")
    return summary
