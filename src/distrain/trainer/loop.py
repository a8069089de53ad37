"""The training loop: one for every way of training; the differences live in engines/.

``train(cfg)`` validates the config and the run folder, then either runs this process as
one rank (when a launcher such as ``distrain launch``/torchrun set RANK and WORLD_SIZE) or
spawns ``cfg.nproc`` local ranks. Each rank runs :func:`run_rank`, which reads top to
bottom: build model, build engine, resume, build data, train (servers serve), checkpoint,
report.

Determinism: the model is initialised from ``cfg.seed`` on every rank; the batch of step s
is a pure function of (seed, s) through DistributedBatchSampler, whatever the number of
ranks; so a run resumed from a checkpoint at step k computes exactly the losses of an
uninterrupted run from step k on.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm, runtime
from distrain.data import DistributedBatchSampler
from distrain.errors import ConfigError
from distrain.launch import spawn
from distrain.trainer import checkpoint, init_from
from distrain.trainer.config import TrainConfig
from distrain.trainer.engines import Engine, build_engine, engine_class
from distrain.trainer.metrics import MetricsLog
from distrain.trainer.report import add_eval, finish, progress_bar, rank_traffic, step_record, sum_losses, write_records
from distrain.trainer.task import Task, build_optimizer, build_task, loss_function, lr_at


def train(cfg: TrainConfig | None = None, *, model=None, train_data=None, val_data=None, loss_fn=None,
          config: TrainConfig | None = None) -> dict:
    """Run a training job; returns rank 0's summary.

    ``cfg``/``config``: the TrainConfig. Your own parts (see trainer/custom.py): ``model`` (an
    nn.Module; every rank trains its own copy, starting from its weights), ``train_data``/
    ``val_data`` (map-style data sets of (x, y) or objects with get_batch; shared read-only),
    ``loss_fn(output, target)`` (it receives the model's output as the model returns it). They
    are pickled to the ranks, so their classes and functions must be importable (module level).

    Your ``model`` is left as it was, whatever its dtype or device: the trained weights are in
    the final checkpoint of ``cfg.out`` (``distrain checkpoint consolidate OUT -o model.pt``
    gives one plain state_dict, whatever the layout; docs/training.md)."""
    cfg = dataclasses.replace(cfg or config or TrainConfig())
    parts = None
    if any(v is not None for v in (model, train_data, val_data, loss_fn)):
        from distrain.trainer.custom import UserParts, as_batches

        parts = UserParts(model, as_batches(train_data, "train_data"), as_batches(val_data, "val_data"), loss_fn)
        if model is not None:
            cfg.model = "custom"
        if train_data is not None:
            cfg.data = "custom"
        if val_data is None and train_data is not None:
            cfg.eval_every = 0  # nothing to evaluate on
    init_from.resolve(cfg)  # the model this run builds: --init-from's, --model hf:DIR, or a left-out --model
    cfg.validate()
    if model is not None and cfg.tp > 1:  # your model's heads, sizes and vocabulary against --tp, before any rank
        from distrain.models.hf.checks import check_tp_fits

        check_tp_fits(model, cfg.tp)
    if cfg.resume == "auto":  # restarts under distrain launch: resume if there is a checkpoint, else start afresh
        cfg.resume = (Path(cfg.out) / checkpoint.MANIFEST).exists()
        cfg.overwrite = cfg.overwrite or not cfg.resume
    if cfg.resume:
        check_resume(cfg)
    init_from.check(cfg, parts)  # --init-from's tensors fit the model; an hf:DIR Llama fits --tp/--pp
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by a launcher: we are one rank
        if not cfg.resume:
            check_out(cfg, remove=int(os.environ["RANK"]) == 0)
        runtime.init(BACKENDS[cfg.device], timeout=cfg.collective_timeout)
        if dist.get_world_size() != cfg.nproc:
            raise ConfigError(f"the launcher started {dist.get_world_size()} ranks but --nproc is {cfg.nproc}")
        return run_rank(cfg, parts)
    from distrain.elastic.nodes import follower

    if not cfg.resume and not (cfg.elastic and follower()):  # (node 0 of an elastic job over several owns --out)
        check_out(cfg)
    if cfg.elastic:  # the elastic agent starts and watches the ranks (distrain/elastic/agent.py)
        from distrain.trainer.elastic_loop import run_elastic

        return run_elastic(cfg, parts.for_ranks() if parts is not None else None, _spawned)
    # ranks that poll shared memory get cores of their own (spawn's bind_cores); Gloo's are left free
    parts = parts.for_ranks() if parts is not None else None  # the model as bytes: no storage shared with the ranks
    return spawn(_spawned, cfg.nproc, args=(cfg.to_dict(), parts), backend=BACKENDS[cfg.device],
                 timeout=cfg.timeout or None, init_timeout=cfg.collective_timeout,
                 bind_cores=None if cfg.transport in ("shm", "auto") else False)[0]


def _spawned(rank: int, cfg_dict: dict, parts=None) -> dict:
    return run_rank(TrainConfig.from_dict(cfg_dict), parts)


# what a run writes into --out; --overwrite removes these and nothing else
RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "config.json", "data.json", "tokenizer.json", "tensorboard/*",
             checkpoint.MANIFEST, "checkpoint-*.pt", ".checkpoint*.tmp")
BACKENDS = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}


def check_out(cfg: TrainConfig, remove: bool = True) -> None:
    """A fresh run needs an empty --out (or --overwrite, which removes the previous run's files)."""
    out = Path(cfg.out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the run's outputs")
    held = sorted(p.name for p in out.iterdir() if p.name != ".distrain.lock")  # the run lock (runlock.py)
    if not held:
        return
    if not cfg.overwrite:
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"--out {out} is not empty ({listed}); pass --resume to continue that run, --overwrite to "
                          f"replace it, or choose another --out")
    for pattern in RUN_FILES if remove else ():
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)


# flags whose change would make a resumed run differ from the uninterrupted one (--steps may grow)
CONTINUATION_FIELDS = ("data", "seed", "batch_size", "dtype", "optimizer", "lr", "weight_decay", "momentum",
                       "algorithm", "compression", "microbatches", "schedule", "max_staleness")


def check_resume(cfg: TrainConfig) -> dict:
    """The committed checkpoint of ``cfg.out`` fits this run, or a one-line ConfigError."""
    manifest = checkpoint.read_manifest(cfg.out)
    checkpoint.verify(cfg.out, manifest)  # checksums, before any rank starts
    where = Path(cfg.out) / checkpoint.MANIFEST
    if manifest.get("model") != cfg.model:
        raise ConfigError(f"--resume: checkpoint {where} holds model {manifest.get('model')!r}, this run trains "
                          f"--model {cfg.model}; resume with the same --model or choose another --out")
    layout = engine_class(cfg).layout_of(cfg)
    if manifest["layout"] != layout and not cfg.reshard:
        raise ConfigError(f"--resume: checkpoint {where} was written with layout {manifest['layout']}, this run uses "
                          f"{layout}; resume with the same --dp/--tp/--pp (and --strategy, --nproc, --servers), or "
                          f"add --reshard to load it into this layout")
    if cfg.reshard:
        ps = [s for s in (manifest.get("strategy"), cfg.strategy) if str(s).startswith("ps-")]
        if ps:
            raise ConfigError(f"--reshard: --strategy {ps[0]} keeps its state on parameter servers, which cannot be "
                              f"resharded; resume it without --reshard and with the same layout")
        first = checkpoint.load(Path(cfg.out) / manifest["files"][0])
        if manifest["layout"] != layout and "names" not in first and first.get("kind") is None:
            raise ConfigError(f"--reshard: {Path(cfg.out) / manifest['files'][0]} records no parameter names (written "
                              f"before distrain could reshard); resume it with its layout {manifest['layout']}")
    saved = manifest.get("config", {})
    # the pipeline's micro-batches and schedule belong to the layout: --reshard may change them
    fields = [f for f in CONTINUATION_FIELDS if not (cfg.reshard and f in ("microbatches", "schedule"))]
    changed = [f for f in fields if f in saved and saved[f] != getattr(cfg, f)]
    if changed:
        f = changed[0]
        raise ConfigError(f"--resume: --{f.replace('_', '-')} is {getattr(cfg, f)!r} but the checkpoint {where} was "
                          f"trained with {saved[f]!r}; a changed {', '.join(changed)} breaks exact continuation: resume "
                          f"with the same value or choose another --out")
    if int(manifest["step"]) > cfg.steps:
        raise ConfigError(f"--resume: checkpoint {where} is at step {manifest['step']}, past --steps {cfg.steps}")
    from distrain.trainer.task import check_resume_data

    check_resume_data(cfg)  # --data DIR of token shards: the same tokenizer as the run's (data.json)
    return manifest


def run_rank(cfg: TrainConfig, parts=None) -> dict:
    if cfg.elastic:  # one rank of an elastic job (trainer/elastic_loop.py)
        from distrain.trainer.elastic_loop import run_elastic_rank

        return run_elastic_rank(cfg, parts, new_model, save_checkpoint)
    comm.set_default_transport(cfg.transport, timeout=cfg.collective_timeout)  # every group this run creates

    out = Path(cfg.out)
    if parts is None:  # --model/--data/--loss PKG.MOD:NAME, built here
        torch.manual_seed(cfg.seed)  # a factory's model: the same seeded weights on every rank, run after run
        parts = init_from.user_parts(cfg)

    # build model: the same seeded model on every rank (engines replicate, shard or serve it),
    # on this rank's device: cuda:LOCAL_RANK under NCCL, the CPU under Gloo
    device = runtime.info().device if cfg.device != "cpu" else torch.device("cpu")
    model = new_model(cfg, parts, device)

    # build engine: the way of training, with its communication and optimizer (engines/)
    engine = build_engine(cfg, model, loss_function(cfg, parts), lambda params: build_optimizer(cfg, params))

    # resume: every rank loads the shard it holds from the committed checkpoint set
    start = 0
    if cfg.resume:
        manifest = checkpoint.read_manifest(out)
        start = int(manifest["step"])
        if manifest["layout"] != engine.layout:  # --reshard (check_resume allowed it): via the whole model
            from distrain.trainer.reshard import consolidate

            engine.load_full(consolidate(out, manifest))
        elif engine.shard is not None:
            engine.load_state_dict(checkpoint.load_shard(out, manifest, engine.shard))

    # train (servers serve), counting every rank's traffic; the final checkpoint set is written
    # right after the last step, before evaluation, so that nothing after training can lose the run
    task, wall = None, 0.0
    with comm.ledger() as led:
        if engine.serves:
            engine.serve(cfg.steps - start)
        else:
            task = build_task(cfg, getattr(getattr(model, "config", None), "block_size", None), device, parts)
            wall = train_steps(cfg, engine, task, start)
    if engine.serves or start >= cfg.steps:  # a server's final shard, or a resume with no step left to run
        save_checkpoint(cfg, engine, cfg.steps)

    # report: traffic and the engine's extras from every rank; rank 0 writes the summary
    traffic = rank_traffic(led, cfg.steps - start)
    extra = engine.report(led, cfg.steps - start)
    return finish(cfg, engine, task, out, wall, start, traffic, extra) if engine.rank == 0 else {}


def new_model(cfg: TrainConfig, parts, device: torch.device) -> torch.nn.Module:
    """The run's model, seeded from ``cfg.seed`` (the same on every rank), on ``device`` in the run's dtype."""
    from distrain.trainer.custom import own_model
    from distrain.trainer.task import check_model_vocab

    torch.manual_seed(cfg.seed)
    model = own_model(parts.model) if parts.model is not None else init_from.build_model(cfg)
    if cfg.init_from:  # a new run from those weights: the whole state dict, on every rank, before the engine shards it
        init_from.load_into(model, cfg)
    check_model_vocab(cfg, model)  # --data DIR of token shards: its ids must fit the embedding
    model = model.to(device=device, dtype=getattr(torch, cfg.dtype))
    if cfg.activation_checkpointing:
        from distrain.models.activation_checkpointing import checkpoint_blocks

        checkpoint_blocks(model)
    return model


def train_steps(cfg: TrainConfig, engine: Engine, task: Task, start: int) -> float:
    """Steps ``start .. cfg.steps - 1``; returns the wall time. Every training rank runs it."""
    is_logger = engine.rank == 0
    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, dp_rank=engine.dp_rank,
                                      dp_size=engine.dp_size, seed=cfg.seed)
    log = MetricsLog(Path(cfg.out) / "metrics.jsonl", start, tensorboard=True) if is_logger else None
    if is_logger:  # the run's settings beside its results (what --resume and readers check)
        (Path(cfg.out) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    bar = progress_bar(cfg, start, engine.label, is_logger)
    pending: list[dict] = []  # step records whose global loss is not summed yet
    t_run = time.perf_counter()
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        x, y = task.batch(task.train, sampler.batch(step))
        lr = lr_at(cfg, step)
        engine.set_lr(lr)
        loss = engine.train_step(x, y)
        pending.append(step_record(step, loss, time.perf_counter() - t0, engine.comm_wait_s, task.unit,
                                   cfg.batch_size * task.units_per_sample, lr))
        last = step == cfg.steps - 1
        if last:
            engine.end_training()
        do_eval = (cfg.eval_every and task.val is not None and engine.can_evaluate
                   and ((step + 1) % cfg.eval_every == 0 or last))
        do_ckpt = bool(cfg.ckpt_every and (step + 1) % cfg.ckpt_every == 0) or last
        if len(pending) >= cfg.log_every or do_eval or do_ckpt:
            sum_losses(pending, engine.loss_group, engine.loss_weight)  # stops every rank on a non-finite loss
            if do_eval and not last:
                add_eval(pending[-1], engine.evaluate(task.val_batches(cfg.batch_size, cfg.eval_batches)), None, bar)
            # the lines are on disk before a checkpoint names their step: a rank killed between the two would
            # otherwise resume past steps that metrics.jsonl never got (a resume drops lines >= its step)
            write_records(pending, log, bar)
            if do_ckpt:  # only finite losses reach a checkpoint
                save_checkpoint(cfg, engine, step + 1)
            if do_eval and last:  # after the final checkpoint, so a failing evaluation leaves it committed
                add_eval(pending[-1], engine.evaluate(task.val_batches(cfg.batch_size, cfg.eval_batches)), log, bar)
            pending = []
    if bar is not None:
        bar.close()
    if log is not None and log.tensorboard is not None:
        log.tensorboard.close()
    return time.perf_counter() - t_run


def save_checkpoint(cfg: TrainConfig, engine: Engine, step: int) -> None:
    """Collective: write this rank's shard (if it writes one); rank 0 commits the set."""
    state = engine.state_dict() if engine.writes_shard else None
    checkpoint.save_set(cfg.out, step, engine.layout, engine.shard if engine.writes_shard else None, state,
                        meta={"model": cfg.model, "strategy": cfg.strategy, "config": cfg.to_dict(),
                              **init_from.run_meta(cfg)})  # an hf:DIR model's config
