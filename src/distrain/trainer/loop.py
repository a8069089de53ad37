"""The training loop: one for every job; the ways of training live in engines/, membership in guard.py.

``train(cfg)`` validates the config and the run folder, then either runs this process as
one rank (when a launcher such as ``distrain launch``/torchrun set RANK and WORLD_SIZE), or
starts ``cfg.nproc`` local ranks through the launcher's supervisor: ``distrain.spawn`` for a
fixed job, the elastic coordinator (distrain.elastic.coordinator, a layer on the same
supervisor) for ``--elastic``. Each rank runs :func:`run_rank`, which reads top to bottom:
build model, build engine (through the guard), resume, build data, train (ps-async servers
serve), checkpoint, report. :func:`train_steps` is the one step loop of every job; a fixed
job's guard does nothing, an elastic job's re-forms the group and the engine when ranks come
and go (trainer/guard.py).

Determinism: the model is initialised from ``cfg.seed`` on every rank; the batch of step s
is a pure function of (seed, s) through DistributedBatchSampler, whatever the number of
ranks; so a run resumed from a checkpoint at step k computes exactly the losses of an
uninterrupted run from step k on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import checkpoint, comm, runtime
from distrain.checkpoint import init_from
from distrain.data import DistributedBatchSampler
from distrain.errors import ConfigError, RankKilledError, TrainingError
from distrain.launch import spawn
from distrain.trainer.config import TrainConfig
from distrain.trainer.custom import UserParts
from distrain.trainer.engines import Engine, build_engine
from distrain.trainer.guard import ElasticGuard, Guard, stop_step
from distrain.trainer.metrics import MetricsLog
from distrain.trainer.run_folder import check_out, check_resume, load_checkpoint, save_checkpoint
from distrain.trainer.replicas import BitFlip, check_inject, check_replicas, flip_bit, parse_inject
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
        from distrain.trainer.custom import as_batches

        parts = UserParts(model, as_batches(train_data, "train_data"), as_batches(val_data, "val_data"), loss_fn)
        if model is not None:
            cfg.model = "custom"
        if train_data is not None:
            cfg.data = "custom"
        if val_data is None and train_data is not None:
            cfg.eval_every = 0  # nothing to evaluate on
    init_from.resolve(cfg)  # the model this run builds: --init-from's, --model hf:DIR, or a left-out --model
    edge = runtime.validate_args()  # what this process's environment says (launched?), read at the edge
    cfg.validate(**edge, available_memory=runtime.available_memory())  # (the Python API too: checks/memory.py)
    inject = check_inject(parse_inject(runtime.injected_fault()), cfg)  # DISTRAIN_INJECT (tests), read at the edge
    if model is not None and cfg.tp > 1:  # your model's heads, sizes and vocabulary against --tp, before any rank
        from distrain.models.hf_transformers.checks import check_tp_fits

        check_tp_fits(model, cfg.tp)
    if model is not None and cfg.cp > 1:  # your model's plan, sequence and heads against --cp, before any rank
        from distrain.models.registry import check_cp_fits

        check_cp_fits(model, cfg.cp, cfg.cp_algorithm, cfg.tp)
    if model is not None and cfg.ep > 1:  # your model's experts against --ep, before any rank
        from distrain.models.registry import check_ep_fits

        check_ep_fits(model, cfg.ep, cfg.dp_size * cfg.cp)
    if cfg.resume == "auto":  # restarts under distrain launch: resume if there is a checkpoint, else start afresh
        cfg.resume = (Path(cfg.out) / checkpoint.MANIFEST).exists()
        cfg.overwrite = cfg.overwrite or not cfg.resume
    if cfg.resume:
        check_resume(cfg)
    init_from.check(cfg, parts)  # --init-from's tensors fit the model; an hf:DIR Llama fits --tp/--pp
    if edge["launched"] is not None:  # started by a launcher: we are one rank
        if not cfg.resume:
            check_out(cfg, remove=edge["launched"][0] == 0)
        runtime.init(BACKENDS[cfg.device], timeout=cfg.collective_timeout)
        if dist.get_world_size() != cfg.nproc:
            raise ConfigError(f"the launcher started {dist.get_world_size()} ranks but --nproc is {cfg.nproc}")
        return run_rank(cfg, parts, inject=inject)
    from distrain.elastic.nodes import follower

    if not cfg.resume and not (cfg.elastic and follower()):  # (node 0 of an elastic job over several owns --out)
        check_out(cfg)
    parts = parts.for_ranks() if parts is not None else None  # the model as bytes: no storage shared with the ranks
    if cfg.elastic:  # the coordinator starts and watches the ranks and decides their membership
        return _run_elastic(cfg, parts)
    try:  # ranks that poll shared memory get cores of their own (spawn's bind_cores); Gloo's are left free
        return spawn(_spawned, cfg.nproc, args=(cfg.to_dict(), parts, inject), backend=BACKENDS[cfg.device],
                     timeout=cfg.timeout or None, init_timeout=cfg.collective_timeout,
                     bind_cores=None if cfg.transport in ("shm", "auto") else False)[0]
    except RankKilledError as e:
        raise killed(cfg, e) from None


def killed(cfg: TrainConfig, e: RankKilledError) -> RankKilledError:
    """The one line for a rank of a fixed job ended by a signal: the signal, what usually sends it, the
    checkpoint there is (or that there is none) and how to go on: --resume, --ckpt-every, --elastic."""
    from distrain.launch.supervisor import signal_cause

    try:
        step = checkpoint.read_manifest(cfg.out)["step"]
    except Exception:  # noqa: BLE001 - no committed checkpoint (or none readable): said so below
        step = None
    if step is not None:
        then = (f"the checkpoint of step {step} is in {cfg.out}: rerun the same command with --resume to go on from "
                f"it, or with --elastic MIN:MAX to keep a job going when a rank is lost")
    else:
        every = (f"--ckpt-every {cfg.ckpt_every} had not come round yet" if cfg.ckpt_every
                 else "--ckpt-every 0 writes one only at the end")
        then = (f"no checkpoint was written ({every}), so the run's work is lost: rerun with --ckpt-every N to keep "
                f"a checkpoint every N steps (--resume goes on from it), or with --elastic MIN:MAX to keep a job "
                f"going when a rank is lost")
    return RankKilledError(e.rank, f"killed by {signal_cause(e.signal)}; the job stopped; {then}", brief=True,
                           signal=e.signal)


def _run_elastic(cfg: TrainConfig, parts) -> dict:
    """The top process of an elastic job: rank 0's summary, or TrainingError with the one-line reason
    of a stop below MIN."""
    from distrain.elastic import check_nodes, coordinator, nodes, parse

    lo, hi = parse(cfg.elastic)
    spread = nodes.from_env(cfg.nproc)  # (cluster run: this node's place, None on one host)
    check_nodes(cfg, spread)
    results, stop, _ = coordinator.run(_spawned, cfg.nproc, lo, hi, args=(cfg.to_dict(), parts),
                                       replace=cfg.elastic_replace, timeout=cfg.timeout or None,
                                       collective_timeout=cfg.collective_timeout, preload=["distrain.trainer.loop"],
                                       grid=(cfg.tp * cfg.cp, cfg.pp),  # (cp x tp: the ranks inside a dp index)
                                       nodes=spread,
                                       servers=cfg.servers if cfg.strategy == "ps-sync" else 0,
                                       # (as a fixed job's spawn: ranks that poll shared memory get cores of their own)
                                       bind_cores=None if cfg.transport in ("shm", "auto") else False)
    if stop:
        raise TrainingError(f"{stop}; the checkpoint of step {stop_step(cfg.out)} is in {cfg.out} (--resume "
                            f"continues it)")
    return next((r for r in results.values() if r), {})


def _spawned(rank: int, cfg_dict: dict, parts=None, inject: BitFlip | None = None) -> dict:
    return run_rank(TrainConfig.from_dict(cfg_dict), parts, inject=inject)


# what a run writes into --out; --overwrite removes these and nothing else
BACKENDS = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}


def run_rank(cfg: TrainConfig, parts=None, step_probe=None, inject: BitFlip | None = None) -> dict:
    """One rank of any job (fixed or elastic: its guard re-forms the group); a context manager
    ``step_probe()``, if given, is entered around each engine step (bench train's memory probe);
    ``inject``: DISTRAIN_INJECT's bit flip (trainer/replicas.py), None in a real run."""
    comm.set_default_transport(cfg.transport, timeout=cfg.collective_timeout)  # every group this run creates
    out = Path(cfg.out)
    if parts is None:  # --model/--data/--loss PKG.MOD:NAME, built here
        torch.manual_seed(cfg.seed)  # a factory's model: the same seeded weights on every rank, run after run
        parts = UserParts.from_config(cfg)

    # build model: the same seeded model on every rank (engines replicate, shard or serve it),
    # on this rank's device: cuda:LOCAL_RANK under NCCL, the CPU under Gloo
    device = runtime.info().device if cfg.device != "cpu" and not cfg.elastic else torch.device("cpu")
    model = new_model(cfg, parts, device)
    task = build_task(cfg, sequence_length(cfg, model), device, parts)

    # build engine: the way of training, with its communication and optimizer (engines/), on the
    # current group (an elastic job builds a new one whenever its group changes)
    loss_fn = loss_function(cfg, parts)

    def make_engine(net=None) -> Engine:
        now = dataclasses.replace(cfg, nproc=dist.get_world_size())  # (elastic: the live ranks)
        net = net if net is not None else new_model(cfg, parts, device)
        return build_engine(now, net, loss_fn, lambda params: build_optimizer(cfg, params))

    # resume: every rank loads what it holds from the committed checkpoint set
    start = int(checkpoint.read_manifest(out)["step"]) if cfg.resume else 0
    guard = _guard(cfg)
    engine, start = guard.enter(make_engine, model, start, (lambda e: load_checkpoint(cfg, e)) if cfg.resume else None)
    model = None  # (the engine holds it, wrapped or sharded)

    # train (ps-async servers serve), counting every rank's traffic; the final checkpoint set is
    # written right after the last step, before evaluation, so that nothing after training can lose the run
    wall, stop = 0.0, None
    with comm.ledger() as led:
        if engine.serves:
            engine.serve(cfg.steps - start)
        else:
            engine, wall, stop = train_steps(cfg, engine, task, start, guard, step_probe, inject)
    if stop is not None:
        return {"stopped": stop} if dist.get_rank() == 0 else {}
    if engine.serves or start >= cfg.steps:  # a server's final shard, or a resume with no step left to run
        save_checkpoint(cfg, engine, cfg.steps)

    # report: traffic and the engine's extras from every rank; rank 0 writes the summary
    traffic = rank_traffic(led, cfg.steps - start)
    extra = engine.report(led, cfg.steps - start)
    if dist.get_rank() != 0:
        return {}
    extra.update(guard.summary(out))
    return finish(cfg, engine, task, out, wall, start, traffic, extra)


def sequence_length(cfg: TrainConfig, model) -> int | None:
    """The length of the blocks the text is cut into: --seq-len (checked before start against a preset's or an
    hf: model's positions; here against your factory's model, ``model.config.block_size``), else the model's
    block size."""
    positions = getattr(getattr(model, "config", None), "block_size", None)
    if cfg.seq_len and positions is not None and cfg.seq_len > positions:
        raise ConfigError(f"--seq-len {cfg.seq_len}: --model {cfg.model} has positions for {positions} tokens "
                          f"(model.config.block_size); give --seq-len {positions} or less")
    return cfg.seq_len or positions


def _guard(cfg: TrainConfig) -> Guard:
    """The job's guard: none for a fixed job, the quorum of this rank's Member for an elastic one."""
    if not cfg.elastic:
        return Guard()
    from distrain.elastic.member import current
    from distrain.checkpoint.reshard import consolidate, consolidate_pieces

    return ElasticGuard(cfg, current(), lambda e, pieces, step: e.load_full(consolidate_pieces(pieces, step)),
                        lambda e: e.load_full(consolidate(cfg.out)))


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


def train_steps(cfg: TrainConfig, engine: Engine, task: Task, start: int, guard: Guard | None = None, step_probe=None,
                inject: BitFlip | None = None):
    """Steps ``start .. cfg.steps - 1``, through membership changes when the guard makes them; returns
    (the engine at the end, the wall time, the stop reason or None). Every training rank runs it.

    Per step: the guard's start, this rank's part of the global batch (the sampler's ``part``, for the engine's dp
    rank and size), the learning rate of the step, the engine's step (with the guard's commit hook; inside
    ``step_probe()`` if given), the guard's end; then the work after the step (:func:`after`). The step lines are
    written (with their losses summed over the ranks) every ``log_every`` steps and before an evaluation or a
    checkpoint; the final checkpoint comes before the final evaluation, so a failing evaluation leaves it committed.
    ``--check-replicas N``: the replicas' bits compared every N steps and before every checkpoint (trainer/replicas.py);
    ``inject`` flips its bit after its step's update."""
    guard = guard or Guard()
    sampler = DistributedBatchSampler(len(task.train), cfg.batch_size, seed=cfg.seed)
    path = Path(cfg.out) / "metrics.jsonl"
    log = MetricsLog(path, start, tensorboard=True) if engine.rank == 0 else None
    if log is not None:  # the run's settings beside its results (what --resume and readers check)
        (Path(cfg.out) / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    bar = progress_bar(cfg, start, engine.label, log is not None)
    pending: list[dict] = []  # step records whose lines are not written yet
    # the records rank 0 wrote at the last write point, kept by every rank until a later quorum proves that rank 0
    # got past that point: a rank 0 lost before writing them leaves them to the next rank 0 (guard.recover)
    unsure: list[dict] = []
    kept = start or None  # the step of the newest checkpoint committed (a resumed run's, then this run's)

    def after(step: int, rec: dict | None) -> None:
        """The work at boundary ``step`` (``rec``: the record of the step just done; None when a change
        brought the group here): the end of training, the lines, evaluation, checkpoint."""
        nonlocal pending, unsure, kept
        last = step == cfg.steps
        if last:
            engine.end_training()
        do_eval = cfg.eval_every and task.val is not None and rec is not None and (step % cfg.eval_every == 0 or last)
        do_ckpt = bool(cfg.ckpt_every and step % cfg.ckpt_every == 0) or last
        if cfg.check_replicas and (step % cfg.check_replicas == 0 or do_ckpt):  # (before any checkpoint of them)
            rec["replica_check_s"] = check_replicas(engine, step, kept, cfg.out)  # (ReplicaMismatchError)
        if len(pending) >= cfg.log_every or do_eval or do_ckpt or rec is None:
            sum_losses(pending, engine.loss_group, engine.loss_weight)  # stops every rank on a non-finite loss
            if do_eval and not last:
                add_eval(rec, engine.evaluate(task.val_batches(cfg.batch_size, cfg.eval_batches)), None, bar)
            if log is not None:
                log.write(guard.events())  # (elastic: the changes completed since the last lines)
            # the lines are on disk before a checkpoint names their step: a rank killed between the two
            # would otherwise resume past steps that metrics.jsonl never got (a resume drops lines >= its step)
            if pending:
                write_records(pending, log, bar)
            unsure, pending = unsure + pending, []
            if do_ckpt:  # only finite losses reach a checkpoint
                save_checkpoint(cfg, engine, step)
                guard.checkpointed(step)
                kept = step
            if do_eval and last:  # after the final checkpoint, so a failing evaluation leaves it committed
                add_eval(rec, engine.evaluate(task.val_batches(cfg.batch_size, cfg.eval_batches)), log, bar)

    step, due, t_run = start, False, time.perf_counter()  # due: the work after ``step`` is still to do
    while step < cfg.steps or due:
        failed = False
        try:
            rec = None
            if not due:
                guard.begin(step, engine)
                t0 = time.perf_counter()
                x, y = task.batch(task.train, sampler.part(step, engine.dp_rank, engine.dp_size, engine.part_unit)) \
                    if engine.reads_data else (None, None)
                lr = lr_at(cfg, step)
                engine.set_lr(lr)
                engine.step_index = step
                with step_probe() if step_probe is not None else contextlib.nullcontext():
                    loss = engine.train_step(x, y, guard.commit_hook(step, engine))
                if inject is not None and (inject.step, inject.rank) == (step, engine.rank):
                    flip_bit(engine.replica_state()[0])  # (tests: silent data corruption on this rank)
                rec = step_record(step, loss, time.perf_counter() - t0, engine.comm_wait_s, task.unit,
                                  cfg.batch_size * task.units_per_sample, lr)
                rec.update(engine.step_metrics())
                guard.end(step, engine, rec)  # (elastic: the loss is summed already)
                unsure = []  # (its quorum proves that rank 0 wrote the lines of the last write point)
                pending.append(rec)
                step += 1
            due = False
            after(step, rec)
        except Exception as e:  # noqa: BLE001 - the group broke (elastic) or a failure of ours (raised)
            if not guard.failed(e):
                raise
            failed = True
        if not (failed or guard.wanted) or (step >= cfg.steps and not failed):
            continue  # (a change asked for after the last step: the job is done)
        # a change (a peer lost, or the coordinator asked): a new group, a new engine, the step to go on from
        held = guard.keep(engine)
        engine = None  # (drop the engine and its hold on the old group)
        engine, step, stop, pending, forward = guard.recover(held, unsure + pending)
        unsure = []
        held = None
        due = forward or step >= cfg.steps  # (the group finished the step under way, or the last one)
        if engine.rank == 0:
            log = log or MetricsLog(path, sys.maxsize, tensorboard=True)  # (a new rank 0: keep every line)
            written = log.rewind(step)  # the step lines from ``step`` on were rolled back
            pending = [r for r in pending if r["step"] not in written]
        if stop is not None:
            save_checkpoint(cfg, engine, step)
            if log is not None:
                log.write(pending + guard.events())
            return engine, time.perf_counter() - t_run, stop
    if bar is not None:
        bar.close()
    if log is not None and log.tensorboard is not None:
        log.tensorboard.close()
    return engine, time.perf_counter() - t_run, None
