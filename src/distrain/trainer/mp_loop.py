"""The training loop for model parallelism: ``distrain train --dp A --tp B --pp C``.

Every rank builds the same seeded GPT, then ``parallelize()`` applies tensor parallel
(tp group), the pipeline split (pp group) and data parallel (dp group), in that order.
Each data-parallel replica reads its slice of the global batch; first-stage ranks feed the
ids, last-stage ranks the targets.

The loss exists on the last stage (identical on its tp ranks); for logging, those ranks of
tp rank 0 contribute loss / dp to one world all-reduce, which gives the global batch's loss
on every rank. Checkpoints: every (tp, pp) coordinate holds a different shard, so dp rank 0
of each writes ``checkpoint-tp{t}-pp{p}.pt`` (its module and optimizer), then rank 0 writes
``checkpoint.pt``, which commits the step and the layout; resume refuses another layout.
Validation runs when pp == 1 (every rank takes part: the tp all-reduces need all of them);
text sampling is not done under model parallelism.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm
from distrain.data import DistributedBatchSampler
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.models.gpt_plan import gpt_tp_plan
from distrain.parallel.parallelize import parallelize
from distrain.topology import Topology
from distrain.trainer import checkpoint
from distrain.trainer.config import TrainConfig
from distrain.trainer.loop import (CKPT_NAME, _finish, _flush, _progress, build_optimizer, build_task, rank_traffic,
                                   step_record)
from distrain.trainer.metrics import MetricsLog


def run_mp_rank(cfg: TrainConfig) -> dict:
    out = Path(cfg.out)
    layout = {"dp": cfg.dp_size, "tp": cfg.tp, "pp": cfg.pp}

    # build topology: the dp x tp x pp grid and its process groups
    topo = Topology.from_world(**layout)
    is_logger = topo.rank == 0

    # build model: the same seeded full model everywhere (tensor parallel takes slices of it)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(getattr(torch, cfg.dtype))

    # build data: each data-parallel replica takes its slice of the global batch
    task = build_task(cfg, model.config.block_size)
    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, dp_rank=topo.dp_rank, dp_size=topo.dp,
                                      seed=cfg.seed)

    # parallelize: tensor, then pipeline, then data parallel (see parallelize.py for why)
    pm = parallelize(model, topo, loss_fn=lm_loss, tp_plan=gpt_tp_plan(), algorithm=cfg.algorithm,
                     microbatches=cfg.microbatches, schedule=cfg.schedule, bucket_cap_mb=cfg.bucket_cap_mb)

    # build optimizer over this rank's shard
    opt = build_optimizer(cfg, pm.parameters())

    # resume
    shard_path = out / f"checkpoint-tp{topo.tp_rank}-pp{topo.pp_rank}.pt"
    start = 0
    if cfg.resume:
        state = checkpoint.load(out / CKPT_NAME)
        if state.get("layout") != layout:
            raise ConfigError(f"checkpoint {out / CKPT_NAME} was written with layout {state.get('layout')}, "
                              f"this run uses {layout}; resume with the same --dp/--tp/--pp")
        start = int(state["step"])
        shard = checkpoint.load(shard_path)
        if int(shard["step"]) != start:
            raise ConfigError(f"{shard_path} is at step {shard['step']} but {out / CKPT_NAME} at {start}: "
                              f"the checkpoint set is inconsistent; start afresh")
        pm.module.load_state_dict(shard["model"])
        opt.load_state_dict(shard["optimizer"])
    log = MetricsLog(out / "metrics.jsonl", start) if is_logger else None
    weight = 1.0 / topo.dp if (pm.has_loss and topo.tp_rank == 0) else 0.0

    # train
    bar = _progress(cfg, start, is_logger)
    pending: list[dict] = []
    t_run = time.perf_counter()
    with comm.ledger() as led:
        for step in range(start, cfg.steps):
            t0 = time.perf_counter()
            x, y = task.batch(task.train, sampler.batch(step))
            opt.zero_grad(set_to_none=True)
            loss = pm.train_step(x, y)
            opt.step()
            dt = time.perf_counter() - t0
            pending.append(step_record(step, loss, dt, pm.comm_wait_s, task, cfg))
            last = step == cfg.steps - 1
            do_eval = cfg.eval_every and topo.pp == 1 and ((step + 1) % cfg.eval_every == 0 or last)
            do_ckpt = (cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or last
            if do_eval:  # every rank: the tensor-parallel loss needs the whole tp group
                pending[-1]["val_loss"] = _evaluate(pm, task, cfg)
            if len(pending) >= cfg.log_every or do_eval or do_ckpt:
                _flush(pending, log, bar, weight=weight)
                pending = []
            if do_ckpt:
                _save(pm, opt, topo, layout, step + 1, cfg, out, shard_path)
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    traffic = rank_traffic(led, cfg.steps - start)
    if not is_logger:
        return {}
    return _finish(cfg, topo.rank, model, task, out, wall, start, traffic,
                   extra={"layout": layout, "microbatches": cfg.microbatches, "schedule": cfg.schedule},
                   can_sample=False)


@torch.no_grad()
def _evaluate(pm, task, cfg: TrainConfig) -> float:
    was = pm.module.training
    pm.module.eval()
    n, losses = len(task.val), []
    for b in range(cfg.eval_batches):
        x, y = task.batch(task.val, torch.arange(b * cfg.batch_size, (b + 1) * cfg.batch_size) % n)
        losses.append(pm.loss_fn(pm.module(x), y).item())
    pm.module.train(was)
    return sum(losses) / len(losses)


def _save(pm, opt, topo: Topology, layout: dict, step: int, cfg: TrainConfig, out: Path, shard_path: Path) -> None:
    if topo.dp_rank == 0:  # dp replicas hold the same shard: one of them writes it
        checkpoint.save(shard_path, {"model": pm.module.state_dict(), "optimizer": opt.state_dict(), "step": step})
    dist.barrier()  # every shard is on disk before rank 0 commits the step
    if topo.rank == 0:
        checkpoint.save(out / CKPT_NAME, {"step": step, "layout": layout, "config": cfg.to_dict()})
