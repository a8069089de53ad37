"""The training loop of an elastic job (``--elastic MIN:MAX``): loop.py's, with a quorum per step.

``run_elastic`` (the top process) runs the ranks under distrain.elastic.agent; ``run_elastic_rank``
is one rank: build the model and data, enter the job (a newcomer receives the state from a live
peer), then train. Per step the loop

    member.begin(step, engine.state_dict)       # a copy of the state at the start of the step
    loss = engine.train_step(x, y)              # this rank's part of the fixed global batch
    loss, change = member.end(step, loss, w)    # "is the group still whole?" (+ the step's loss)

and on a change (the agent asked, or a collective raised because a peer vanished) ``member.reform``
gives a new group of the live ranks and the state at the step to go on from; the loop builds a new
engine on that group and loads it, so the engine never sees a dead rank.

Exactness: the global batch of step s is the same whatever the world size (the sampler's
``global_batch``); data-parallel replica d of D takes a contiguous part of it (sizes differ by at
most one: elastic.member.part_bounds). DDP/ZeRO average gradients over the D replicas, so a
replica's loss is scaled by n_d * D / B: the sum is the exact gradient of the global batch's mean
loss, for any D (the scale is exactly 1 when D divides B, the usual step). A replica is one rank,
or with --tp/--pp the tp x pp ranks of one model copy; the job then gains and loses whole
replicas (agent.whole_replicas), and every survivor keeps its (tp, pp) shard. Every step's loss
is summed over the group in ``end``, so metrics.jsonl holds the global batch's loss step by step;
a rolled-back step's line is dropped and written again. Membership changes are lines with ``"event"``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm
from distrain.data import DistributedBatchSampler
from distrain.errors import TrainingError
from distrain.topology import Topology
from distrain.trainer import checkpoint, init_from
from distrain.trainer.config import TrainConfig
from distrain.trainer.engines import build_engine
from distrain.trainer.metrics import MetricsLog
from distrain.trainer.report import finish, progress_bar, rank_traffic, step_record
from distrain.trainer.task import build_optimizer, build_task, loss_function, lr_at


def run_elastic(cfg: TrainConfig, parts, rank_fn) -> dict:
    """The top process: rank 0's summary, or TrainingError with the one-line reason of a stop below MIN."""
    from distrain.elastic import agent, nodes, parse

    lo, hi = parse(cfg.elastic)
    results, stop, _ = agent.run(rank_fn, cfg.nproc, lo, hi, args=(cfg.to_dict(), parts), replace=cfg.elastic_replace,
                                 timeout=cfg.timeout or None, collective_timeout=cfg.collective_timeout,
                                 preload=["distrain.trainer.loop"], grid=(cfg.tp, cfg.pp),
                                 nodes=nodes.from_env(cfg.nproc),  # one node of several (cluster run)
                                 servers=cfg.servers if cfg.strategy == "ps-sync" else 0)
    if stop:
        raise TrainingError(f"{stop}; the checkpoint of step {stop_step(cfg)} is in {cfg.out} (--resume continues it)")
    return next((r for r in results.values() if r), {})


def stop_step(cfg: TrainConfig):
    try:
        return checkpoint.read_manifest(cfg.out)["step"]
    except Exception:  # noqa: BLE001 - the message names what is there
        return "?"


def read_events(path) -> list[dict]:
    """The membership lines of a metrics.jsonl."""
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    return [r for r in rows if "event" in r]


def _reopen(log: MetricsLog | None, path: Path, step: int) -> MetricsLog:
    """Rank 0 after a change: drop the step lines from ``step`` on (rolled back), keep every event line."""
    rows = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    kept = [ln for ln in rows if "event" in (r := json.loads(ln)) or r["step"] < step]
    path.write_text("".join(ln + "\n" for ln in kept))
    return log if log is not None else MetricsLog(path, sys.maxsize, tensorboard=True)


def run_elastic_rank(cfg: TrainConfig, parts, new_model, save_checkpoint) -> dict:
    """One rank; ``new_model(cfg, parts, device)`` and ``save_checkpoint(cfg, engine, step)`` are loop.py's."""
    from distrain.elastic.member import current, part_bounds

    q = current()
    device = torch.device("cpu")
    if parts is None:  # --model/--data/--loss PKG.MOD:NAME
        torch.manual_seed(cfg.seed)
        parts = init_from.user_parts(cfg)
    model = new_model(cfg, parts, device)
    task = build_task(cfg, getattr(getattr(model, "config", None), "block_size", None), device, parts)
    base_loss = loss_function(cfg, parts)

    def make_engine(net=None):
        """A new engine on the current group (its replica's part of the batch decides the loss scale)."""
        now = dataclasses.replace(cfg, nproc=q.world)  # (--tp/--pp: dp = the live replicas)
        if cfg.strategy == "ps-sync":  # the workers are the first world - servers ranks (the servers: no data)
            size = q.world - cfg.servers
            dp = min(q.rank, size - 1)
        else:
            size = now.dp_size
            dp = Topology(size, cfg.tp, cfg.pp, rank=q.rank, world_size=q.world).dp_rank
        lo, hi = part_bounds(cfg.batch_size, size, dp)
        scale = (hi - lo) * size / cfg.batch_size
        loss_fn = base_loss if scale == 1 else (lambda out, y: base_loss(out, y) * scale)
        net = net if net is not None else new_model(cfg, parts, device)
        return build_engine(now, net, loss_fn, lambda params: build_optimizer(cfg, params))

    start, manifest = 0, None
    if cfg.resume:
        manifest = checkpoint.read_manifest(cfg.out)
        start = q.ckpt_step = int(manifest["step"])
    q.sharded = cfg.strategy.startswith("zero")  # each rank holds a piece of the state (ZeRO), not all of it
    change = q.join(start)  # a newcomer waits here for a step boundary, then gets the state
    try:
        engine = make_engine(model)
        if change is not None:
            load_change(cfg, q, engine, change)
    except Exception as e:  # noqa: BLE001 - a newcomer: a peer lost while its first engine was built or loaded
        if change is None or not q.failed(e):
            raise
        engine, change = _rebuild(cfg, q, make_engine, lambda: None)  # it offers the state it was sent
    if change is not None:
        start = change.step
    elif manifest is not None:
        engine.load_state_dict(checkpoint.load_shard(cfg.out, manifest, engine.shard))
    with comm.ledger() as led:
        engine, wall, stop = elastic_steps(cfg, q, make_engine, engine, task, start, change, save_checkpoint)
    if stop is not None:
        return {"stopped": stop} if q.rank == 0 else {}
    traffic = rank_traffic(led, cfg.steps - start)
    extra = engine.report(led, cfg.steps - start)
    if q.rank != 0:
        return {}
    events = [e for e in read_events(Path(cfg.out) / "metrics.jsonl") if e["event"] == "membership"]
    extra.update(membership_changes=len(events), world_final=q.world,
                 ranks_left=sum(len(e["left"]) for e in events), ranks_joined=sum(len(e["joined"]) for e in events))
    return finish(cfg, engine, task, Path(cfg.out), wall, start, traffic, extra)


def _rebuild(cfg: TrainConfig, q, make_engine, state_fn):
    """A new group and a new engine holding the agreed state; again while peers fail meanwhile."""
    while True:
        c = q.reform(state_fn)
        try:
            engine = make_engine()
            load_change(cfg, q, engine, c)
            return engine, c
        except Exception as e:  # noqa: BLE001 - a peer lost while the engine was built (DDP's broadcast)
            if not q.failed(e):
                raise


def load_change(cfg: TrainConfig, q, engine, c) -> None:
    """Load the state a membership change agreed on into ``engine`` (built on the new group).

    Replicated state (ddp): the copy this rank holds or was sent. Sharded state (ZeRO): every rank
    brings the pieces it holds at the step (its own, and its replica of its predecessor's), all are
    gathered (a collective), the pieces of one layout are joined into the whole model and optimizer
    (reshard.consolidate_pieces) and this rank takes its part of the new layout (``load_full``, as
    ``--reshard`` does). ``source == "checkpoint"``: the last committed checkpoint, read from disk."""
    if c.source == "checkpoint":
        from distrain.trainer.reshard import consolidate

        engine.load_full(consolidate(cfg.out))
    elif q.sharded:
        from distrain.trainer.reshard import consolidate_pieces

        held = [None] * q.world
        dist.all_gather_object(held, (c.state["pieces"], c.state["rng"]))
        engine.load_full(consolidate_pieces([p for ps, _ in held for p in ps], c.step))
        if c.state["rng"] is None:  # no state of ours at that step: the first rank's generator that has one
            c.state["rng"] = next(rng for _, rng in held if rng is not None)
    else:
        engine.load_state_dict(c.state["engine"])
    torch.set_rng_state(c.state["rng"])


def elastic_steps(cfg: TrainConfig, q, make_engine, engine, task, step: int, change, save_checkpoint):
    """Steps ``step .. cfg.steps - 1`` through membership changes; returns (engine, wall time, stop reason)."""
    from distrain.elastic.member import part_bounds
    from distrain.elastic.pieces import clone_tree

    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, seed=cfg.seed)  # global batches
    path = Path(cfg.out) / "metrics.jsonl"
    log = MetricsLog(path, step, tensorboard=True) if q.rank == 0 else None
    if log is not None:
        (Path(cfg.out) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    bar = progress_bar(cfg, step, engine.label, q.rank == 0)
    event = change.event() | {"t0": change.t0, "spawned": change.spawned, "t_left": 0} if change is not None else None
    t_run = time.perf_counter()
    while step < cfg.steps:
        failed = False
        try:
            t_copy = time.perf_counter()
            q.begin(step, engine.state_dict)  # the start-of-step copy (+ ZeRO: the replica exchange)
            t0 = time.perf_counter()
            lo, hi = part_bounds(cfg.batch_size, engine.dp_size, engine.dp_rank)  # this replica's part
            x, y = task.batch(task.train, sampler.global_batch(step)[lo:hi])
            lr = lr_at(cfg, step)
            engine.set_lr(lr)
            loss = engine.train_step(x, y)
            total, wanted = q.end(step, loss, engine.loss_weight)
            rec = step_record(step, None, time.perf_counter() - t0, engine.comm_wait_s, task.unit,
                              cfg.batch_size * task.units_per_sample, lr) | {"loss": total, "world": q.world,
                                                                    "copy_s": t0 - t_copy}
            if not math.isfinite(total):
                raise TrainingError(f"step {step}: the loss is {total}; the run stops before writing it or a "
                                    f"checkpoint: lower --lr, use --dtype float64, or check the data")
            step += 1
            last = step == cfg.steps
            if last:
                engine.end_training()
            if cfg.eval_every and task.val is not None and (step % cfg.eval_every == 0 or last):
                val = engine.evaluate(task.val_batches(cfg.batch_size, cfg.eval_batches))
                rec.update(val or {})
            if event is not None:  # the first step at the new size is done: the change is complete
                now = time.time()
                done = {k: v for k, v in event.items() if k not in ("t0", "spawned", "t_left")}
                done.update(recover_s=now - event["t0"], pause_s=now - (event["t_left"] or now), time=now)
                if event["joined"]:
                    done["join_s"] = now - min(event["spawned"].get(str(i), now) for i in event["joined"])
                event = None
                if log is not None:
                    log.write([done])
            if log is not None:
                log.write([rec])
            if bar is not None:
                bar.set_postfix(loss=f"{total:.4f}", world=q.world)
                bar.update(1)
            if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or last:  # after the lines of the steps it names
                save_checkpoint(cfg, engine, step)
                q.ckpt_step = step  # (sharded state: the fallback when a piece is lost with its replica)
        except Exception as e:  # noqa: BLE001 - a peer gone (reset, closed, timed out)? else it is ours
            if not q.failed(e):
                raise
            failed = wanted = True
        if not wanted or (step >= cfg.steps and not failed):
            continue
        # the live state may be the one to go on from: keep a copy, drop the engine (and its hold on the old group)
        live = clone_tree(engine.state_dict()) if q.live is not None else None
        engine = None
        engine, c = _rebuild(cfg, q, make_engine, lambda: live)
        live = None
        step = c.step
        if q.rank == 0:
            log = _reopen(log, path, step)
        if c.stop is not None:
            save_checkpoint(cfg, engine, step)
            if log is not None:
                log.write([c.event() | {"event": "stop", "reason": c.stop}])
            return engine, time.perf_counter() - t_run, c.stop
        event = c.event() | {"t0": c.t0, "spawned": c.spawned, "t_left": c.t_left}
    if bar is not None:
        bar.close()
    if log is not None and log.tensorboard is not None:
        log.tensorboard.close()
    return engine, time.perf_counter() - t_run, None
