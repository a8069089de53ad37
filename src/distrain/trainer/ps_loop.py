"""The training loop for parameter-server strategies (``ps-sync``, ``ps-async``).

Roles come from PSLayout: the last S ranks serve, the first W = nproc - S work. Servers
load no data; they hold their shard and its optimizer and answer pulls and pushes
(distrain.parallel.parameter_server). Workers read their slice of each global batch and run
``pull -> forward/backward -> push``; rank 0 (always a worker) logs and evaluates.

Checkpoints: the servers own the weights and optimizer state, so a checkpoint is one file
per server (its shard and optimizer) plus rank 0's ``checkpoint.pt``, written last, which
commits the step; resume checks that every file agrees on it. They are written at the end
of the run (mid-run, the state is spread over messages in flight), so ``--ckpt-every`` is
refused for these strategies; a run of k steps resumed to n steps equals a run of n steps
in sync mode.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm
from distrain.data import DistributedBatchSampler
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker, expected_ps_bytes
from distrain.trainer import checkpoint
from distrain.trainer.config import TrainConfig
from distrain.trainer.loop import (CKPT_NAME, _finish, _flush, _progress, build_optimizer, build_task, evaluate,
                                   rank_traffic, step_record)
from distrain.trainer.metrics import MetricsLog


def _server_ckpt(out: Path, s: int) -> Path:
    return out / f"checkpoint-server{s}.pt"


def run_ps_rank(cfg: TrainConfig) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(cfg.out)
    mode = "sync" if cfg.strategy == "ps-sync" else "async"

    # build model (the same seed everywhere: servers take their shards from it)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model).to(getattr(torch, cfg.dtype))

    # build topology: roles, shards, and the workers' group (every rank must create it)
    layout = PSLayout.from_model(model, world, cfg.servers)
    workers_group = dist.new_group(layout.workers)

    # resume: the step is committed by rank 0's file
    start = int(checkpoint.load(out / CKPT_NAME)["step"]) if cfg.resume else 0
    if start > cfg.steps:
        raise ConfigError(f"checkpoint {out / CKPT_NAME} is at step {start}, past --steps {cfg.steps}")

    with comm.ledger() as led:
        if layout.is_server(rank):
            summary, stats = {}, _serve(cfg, model, layout, mode, out, start)
        else:
            summary, stats = _work(cfg, model, layout, mode, workers_group, out, start)
    traffic = rank_traffic(led, cfg.steps - start)
    # the data messages' bytes of this rank, to check against the fan-in/fan-out formula
    stats["ledger"] = {f"{lab}_{d}": getattr(led.get(lab, "p2p"), f"bytes_{d}")
                       for lab in ("ps_pull", "ps_push") for d in ("sent", "recv")}
    every = [None] * world
    dist.all_gather_object(every, stats)
    if rank != 0:
        return {}
    servers = [s for s in every if s and s.get("role") == "server"]
    expected = expected_ps_bytes(layout, cfg.steps - start, final_pull=True)
    extra = {"servers": [{k: v for k, v in s.items() if k != "apply_order"} for s in servers],
             "staleness_max": max(s["staleness_max"] for s in servers),
             "ps_bytes": [{"rank": r, "role": layout.role(r), "ledger": every[r]["ledger"],
                           "expected": {k: v for k, v in expected[r].items() if k.startswith("ps_")}}
                          for r in range(world)]}
    extra["ps_bytes_match"] = all(row["ledger"] == row["expected"] for row in extra["ps_bytes"])
    return _finish(cfg, rank, model, summary["task"], out, summary["wall"], start, traffic, extra=extra)


def _serve(cfg: TrainConfig, model, layout: PSLayout, mode: str, out: Path, start: int) -> dict:
    s = layout.server_index(dist.get_rank())
    server = ParameterServer(model, layout, lambda params: build_optimizer(cfg, params), mode,
                             max_staleness=cfg.max_staleness)
    if cfg.resume:
        state = checkpoint.load(_server_ckpt(out, s))
        if int(state["step"]) != start:
            raise ConfigError(f"{_server_ckpt(out, s)} is at step {state['step']} but {out / CKPT_NAME} at {start}: "
                              f"the checkpoint set is inconsistent (a run died while writing it); start afresh")
        with torch.no_grad():
            server.flat.copy_(state["flat"])
        server.optimizer.load_state_dict(state["optimizer"])
    stats = server.serve(cfg.steps - start)
    checkpoint.save(_server_ckpt(out, s), {"step": cfg.steps, "flat": server.flat,
                                           "optimizer": server.optimizer.state_dict()})
    dist.barrier()  # every server file is written before rank 0 commits the step
    return stats


def _work(cfg: TrainConfig, model, layout: PSLayout, mode: str, group, out: Path, start: int):
    rank = dist.get_rank()
    is_logger = rank == 0
    task = build_task(cfg, getattr(getattr(model, "config", None), "block_size", None))
    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, dp_rank=layout.workers.index(rank),
                                      dp_size=layout.num_workers, seed=cfg.seed)
    worker = PSWorker(model, layout, mode)
    log = MetricsLog(out / "metrics.jsonl", start) if is_logger else None
    bar = _progress(cfg, start, is_logger)
    pending: list[dict] = []
    t_run = time.perf_counter()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        comm_before = worker.pull_s + worker.push_s
        worker.pull()
        x, y = task.batch(task.train, sampler.batch(step))
        loss = task.loss_fn(model(x), y)
        loss.backward()
        worker.push()
        dt = time.perf_counter() - t0
        pending.append(step_record(step, loss, dt, worker.pull_s + worker.push_s - comm_before, task, cfg))
        if len(pending) >= cfg.log_every or step == cfg.steps - 1:
            _flush(pending, log, bar, group=group)
            pending = []
    worker.pull()  # the final weights, the same on every worker
    wall = time.perf_counter() - t_run
    if bar is not None:
        bar.close()
    if is_logger and cfg.eval_every:
        val = evaluate(model, task, cfg)
        log.rewrite_last(val_loss=val)
    dist.barrier()  # the servers have written their files
    if is_logger:
        checkpoint.save(out / CKPT_NAME, {"model": model.state_dict(), "step": cfg.steps, "config": cfg.to_dict()})
    return {"task": task, "wall": wall}, worker.stats()
