"""The strategy's own rules: the flags it acts on, its process counts, what it can checkpoint, --elastic."""

from __future__ import annotations

from dataclasses import fields

from distrain.trainer.checks.need import need
from distrain.trainer.choices import either


def check_elastic(cfg, launched: tuple[int, int] | None) -> None:
    """--elastic MIN:MAX: its strategy, MIN <= MAX, MIN <= --nproc, not under a launcher (elastic/spec.py)."""
    from distrain.elastic import check

    check(cfg, launched)


def check_processes(cfg) -> None:
    """single: one process; ps-*: servers and at least one worker, no mid-run checkpoint; local: no one
    state to resume or checkpoint; --max-staleness: ps-async's, >= 0."""
    if cfg.strategy == "single":
        need(cfg.nproc == 1, f"--strategy single runs one process; got --nproc {cfg.nproc} (use --nproc 1, "
                             f"or --strategy ddp for {cfg.nproc} processes)")
    if cfg.strategy.startswith("ps-"):
        need(cfg.servers >= 1, f"--servers must be >= 1, got {cfg.servers}")
        need(cfg.nproc >= cfg.servers + 1,
             f"--nproc {cfg.nproc} is too small for --servers {cfg.servers}: a parameter server job needs "
             f"at least {cfg.servers + 1} processes ({cfg.servers} server(s) + at least 1 worker)")
        need(cfg.ckpt_every == 0, "--ckpt-every is not supported with parameter servers: their checkpoint is "
                                  "written at the end of the run (servers hold the state mid-run); drop the flag")
    if cfg.strategy == "local":
        need(not cfg.resume and cfg.ckpt_every == 0,
             "--strategy local trains P unsynchronized replicas (a benchmark floor); there is no one state to "
             "resume or checkpoint mid-run: drop --resume/--ckpt-every, or use --strategy ddp")
    if cfg.max_staleness is not None:
        need(cfg.strategy == "ps-async", "--max-staleness applies only to --strategy ps-async")
        need(cfg.max_staleness >= 0, f"--max-staleness must be >= 0, got {cfg.max_staleness}")


def check_replicas(cfg) -> None:
    """--check-replicas N compares replicas: refused where the ranks hold none (trainer/replicas.py no_replicas)."""
    from distrain.trainer.replicas import no_replicas

    why = no_replicas(cfg) if cfg.check_replicas else None
    need(why is None, f"--check-replicas {cfg.check_replicas} compares the bits of replicas, but {why}; drop "
                      f"--check-replicas or use --strategy ddp")


def check_applies(cfg) -> None:
    """A flag set to anything but its default for a strategy it does not act on is refused (``opt``'s
    ``only`` in trainer/config.py); --accum-steps and --elastic say why in their own checks."""
    for f in fields(cfg):
        only, value = f.metadata.get("only"), getattr(cfg, f.name)
        if not only or value == f.default or f.name in ("accum_steps", "elastic"):
            continue
        flag = "--" + f.name.replace("_", "-")
        need(cfg.strategy in only, f"{flag} applies only to --strategy {either(only)}; --strategy "
                                   f"{cfg.strategy} does not use it: drop {flag} {value}")
    need(cfg.compression is None or not cfg.model_parallel,
         f"--compression {cfg.compression}: the data-parallel part of a --tp/--pp layout does not compress; "
         f"drop --compression, or train with --strategy ddp alone")
