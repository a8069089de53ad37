"""Each flag on its own: a name among its choices, a number in its range (no flag against another)."""

from __future__ import annotations

import math

from distrain.comm import ALGORITHM_NAMES, TRANSPORT_NAMES
from distrain.optim import OPTIMIZERS
from distrain.trainer.checks.need import need
from distrain.trainer.choices import AUTOCASTS, CP_ALGORITHMS, DEVICES, DTYPES, LR_SCHEDULES, SCHEDULES, SEED_MAX, \
    STRATEGIES


def check_strategy_name(cfg) -> None:
    need(cfg.strategy in STRATEGIES,
         f"--strategy {cfg.strategy!r} is unknown; use one of {', '.join(STRATEGIES)}")


def check_names(cfg) -> None:
    """--model, --loss, --algorithm, --transport, --optimizer, --dtype, --compression: known values
    (a PKG.MOD:NAME one: :func:`check_importable`)."""
    from distrain.models import list_models
    from distrain.models.registry import SHAPE_ONLY_PRESETS

    trainable = [m for m in list_models() if m not in SHAPE_ONLY_PRESETS]
    need(cfg.model in list_models() or cfg.custom_model,
         f"--model {cfg.model!r} is unknown; use one of {', '.join(trainable)}, or PKG.MOD:FACTORY (shape-only, "
         f"for `distrain plan`: {', '.join(sorted(SHAPE_ONLY_PRESETS))})")
    need(cfg.model not in SHAPE_ONLY_PRESETS,
         f"--model {cfg.model} is a shape-only preset: its published sizes, for `distrain plan` and the cost model "
         f"(no weights, and too large to train from scratch here); to train the real model, download its Hugging "
         f"Face folder and give --init-from DIR (docs/llama.md)")
    need(cfg.loss in ("auto", "cross-entropy", "mse") or ":" in cfg.loss,
         f"--loss {cfg.loss!r} is unknown; use auto, cross-entropy, mse or PKG.MOD:FN")
    need(cfg.algorithm in ALGORITHM_NAMES,
         f"--algorithm {cfg.algorithm!r} is unknown; use one of {', '.join(ALGORITHM_NAMES)}")
    need(cfg.transport in TRANSPORT_NAMES,
         f"--transport {cfg.transport!r} is unknown; use one of {', '.join(TRANSPORT_NAMES)}")
    need(cfg.optimizer in OPTIMIZERS,
         f"--optimizer {cfg.optimizer!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    need(cfg.dtype in DTYPES, f"--dtype {cfg.dtype!r} is unknown; use one of {', '.join(DTYPES)}")
    need(cfg.compression in (None, "bf16", "fp16"),
         f"--compression must be bf16 or fp16, got {cfg.compression!r}")


def check_importable(cfg) -> None:
    """--model, --data, --loss PKG.MOD:NAME: the module imports and holds NAME, here, before any rank starts
    (each rank imports it again; a missing module is one line, not every rank's failure)."""
    from distrain.checkpoint.models import is_hf_name
    from distrain.factories import is_spec, load_object

    for flag, value in (("--model", cfg.model), ("--data", cfg.data), ("--loss", cfg.loss)):
        if is_spec(value) and not is_hf_name(value):
            load_object(value, flag)


def check_nproc(cfg) -> None:
    need(isinstance(cfg.nproc, int) and cfg.nproc >= 1, f"--nproc must be >= 1, got {cfg.nproc}")


def check_numbers(cfg) -> None:
    """--seed, --steps, --lr, --weight-decay, --momentum, --bucket-cap-mb: in range and finite."""
    need(isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool) and 0 <= cfg.seed <= SEED_MAX,
         f"--seed must be an integer in 0..2**63-1 (0..{SEED_MAX}), got {cfg.seed!r}")
    need(cfg.steps >= 1, f"--steps must be >= 1, got {cfg.steps}")
    need(math.isfinite(cfg.lr) and cfg.lr > 0, f"--lr must be a positive finite number, got {cfg.lr}")
    need(math.isfinite(cfg.weight_decay) and cfg.weight_decay >= 0,
         f"--weight-decay must be a finite number >= 0, got {cfg.weight_decay}")
    need(math.isfinite(cfg.momentum) and 0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}")
    need(math.isfinite(cfg.bucket_cap_mb) and cfg.bucket_cap_mb > 0,
         f"--bucket-cap-mb must be a positive finite number, got {cfg.bucket_cap_mb}")


def check_bookkeeping(cfg) -> None:
    """--timeout, --collective-timeout, --log-every, --eval-every, --ckpt-every, --eval-batches, --check-replicas."""
    need(math.isfinite(cfg.timeout) and cfg.timeout >= 0,
         f"--timeout must be a number of seconds >= 0 (0: no limit), got {cfg.timeout}")
    need(math.isfinite(cfg.collective_timeout) and cfg.collective_timeout > 0,
         f"--collective-timeout must be a positive number of seconds, got {cfg.collective_timeout}")
    need(cfg.log_every >= 1 and cfg.eval_every >= 0 and cfg.ckpt_every >= 0,
         "--log-every must be >= 1; --eval-every and --ckpt-every must be >= 0")
    need(isinstance(cfg.check_replicas, int) and cfg.check_replicas >= 0,
         f"--check-replicas must be a number of steps >= 0 (0: off), got {cfg.check_replicas!r}")
    need(cfg.eval_every == 0 or cfg.eval_batches >= 1,
         f"--eval-batches must be >= 1 when evaluating, got {cfg.eval_batches} (use --eval-every 0 to skip evaluation)")


def check_schedule_name(cfg) -> None:
    need(cfg.schedule in SCHEDULES,
         f"--schedule must be gpipe or 1f1b, interleaved (--virtual-stages chunks per rank) or zb-h1 (zero "
         f"bubble); got {cfg.schedule!r}")


def check_optimization(cfg) -> None:
    """--lr-schedule, --warmup-steps, --min-lr, --grad-clip, --autocast, --accum-steps, --device."""
    need(cfg.lr_schedule in LR_SCHEDULES,
         f"--lr-schedule {cfg.lr_schedule!r} is unknown; use one of {', '.join(LR_SCHEDULES)}")
    need(cfg.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {cfg.warmup_steps}")
    need(0 <= cfg.min_lr <= cfg.lr, f"--min-lr must be in [0, --lr], got {cfg.min_lr}")
    need(math.isfinite(cfg.grad_clip) and cfg.grad_clip >= 0,
         f"--grad-clip must be >= 0 (0: off), got {cfg.grad_clip}")
    need(cfg.autocast in AUTOCASTS, f"--autocast {cfg.autocast!r} is unknown; use one of {', '.join(AUTOCASTS)}")
    need(cfg.accum_steps >= 1, f"--accum-steps must be >= 1, got {cfg.accum_steps}")
    need(cfg.device in DEVICES, f"--device {cfg.device!r} is unknown; use one of {', '.join(DEVICES)}")


def check_grid_sizes(cfg) -> None:
    """--tp, --pp, --cp, --ep, --microbatches >= 1, --dp >= 0; --cp-algorithm known."""
    need(min(cfg.tp, cfg.pp, cfg.cp, cfg.ep, cfg.microbatches) >= 1 and cfg.dp >= 0,
         "--tp, --pp, --cp, --ep and --microbatches must be >= 1, --dp >= 0 (0: whatever is left of --nproc)")
    need(cfg.cp_algorithm in CP_ALGORITHMS,
         f"--cp-algorithm {cfg.cp_algorithm!r} is unknown; use ring or all-to-all")


def check_batch_size(cfg) -> None:
    need(cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}")
