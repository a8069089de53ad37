"""``distrain train``: the flags are :class:`~distrain.trainer.config.TrainConfig`'s fields.

One flag per field (``batch_size`` -> ``--batch-size``): its type from the default, its help
text and allowed values from the field's metadata (``trainer.config.opt``), so TrainConfig is
the single source of the train flags. ``--config run.toml`` makes the file's settings the
defaults, so flags given beside it override them. The run itself is :func:`distrain.trainer.train`
under the run lock (rank 0 of a launched job, node 0 of an elastic one, holds it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from distrain.cli.common import read_toml
from distrain.errors import ConfigError


def add_parser(sub) -> None:
    """``distrain train`` on the subparsers ``sub``."""
    from distrain.trainer.config import TrainConfig

    p = sub.add_parser("train", help="train a model: one process, DDP, torch DDP, dp x tp x pp or parameter servers",
                       description="Train a model on one or many processes; see docs/training.md.")
    p.add_argument("--config", metavar="RUN.toml", default=None,
                   help="read settings from a TOML file (keys: the flags' names); flags given here override it")
    config_arguments(p, TrainConfig)
    p.set_defaults(func=run)


def resume_value(v: str):
    """--resume (yes), --resume auto (if a checkpoint exists), --resume no."""
    low = v.lower()
    if low == "auto":
        return "auto"
    if low in ("yes", "true", "1"):
        return True
    if low in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"--resume takes no value, or auto / yes / no; got {v!r}")


def config_arguments(p: argparse.ArgumentParser, cls) -> None:
    """One flag per dataclass field (``batch_size`` -> ``--batch-size``): type from its default,
    help text and allowed values from its metadata (``trainer.config.opt``), so there is one source."""
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        meta = f.metadata
        choices = meta.get("choices")
        help_text = meta.get("help", "") + (f" [{' | '.join(map(str, choices))}]" if choices else "")
        help_text += " (default: %(default)s)"
        if f.name == "resume":
            p.add_argument(flag, nargs="?", const=True, default=default, type=resume_value, metavar="auto",
                           help=help_text)
            p.add_argument("--no-resume", dest="resume", action="store_false", default=default,
                           help="start afresh (the default)")
        elif f.name == "model" and cls.__name__ == "TrainConfig":  # left out: None, resolved by checkpoint/init_from.py
            p.add_argument(flag, default=None, metavar="MODEL", help=help_text.replace(
                "%(default)s", f"{default}; with --init-from or --resume: the checkpoint's model"))
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            kind = meta.get("type") or (type(default) if default is not None else str)
            p.add_argument(flag, type=kind, default=default, help=help_text,
                           metavar=f.name.upper())


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``train --config run.toml``: the file's settings become the defaults, so flags override them."""
    if not argv or argv[0] != "train":
        return
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if path is None:
        return
    from distrain.trainer.config import TrainConfig  # (torch: only for a train command, which imports it anyway)

    settings = read_toml(path)
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in settings.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(f"--config {path}: unknown setting {key!r}; settings are the train flags' names "
                              f"(e.g. batch-size or batch_size)")
        values[name] = value
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["train"].set_defaults(**values)


def run(args: argparse.Namespace) -> int:
    from distrain import checkpoint, runlock, runtime
    from distrain.checkpoint import init_from
    from distrain.trainer import TrainConfig, train

    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func", "config")})
    if cfg.resume is False and os.environ.get("DISTRAIN_RESUME") == "auto":  # set by launch --max-restarts
        cfg.resume = "auto"
    init_from.resolve(cfg)  # a left-out --model: the default, or --init-from's / --resume's checkpoint's
    # this host's available memory: the ranks this process spawns must hold the model (trainer/checks/memory.py)
    cfg.validate(**runtime.validate_args(os.environ), available_memory=runtime.available_memory())
    from distrain.trainer.replicas import check_inject, parse_inject

    check_inject(parse_inject(runtime.injected_fault(os.environ)), cfg)  # (train() again; here: before --out is made)
    if not cfg.resume:
        init_from.check(cfg)  # --init-from's weights fit the model: refused before --out is made
    from distrain.elastic.nodes import follower

    # one rank of a launched job, or a node other than 0 of an elastic one: rank 0 / node 0 holds the lock
    launched = runtime.launched_rank(os.environ)
    if (launched is not None and launched[0] != 0) or (cfg.elastic and follower()):
        train(cfg)
        return 0
    if cfg.resume is True:
        checkpoint.read_manifest(cfg.out)  # --resume on a folder without a checkpoint: refused before it is made
    # the lock file goes at the end; a run that fails before it wrote a step line or a checkpoint takes the folder
    # it created with it (nothing half-written)
    with runlock.hold(cfg.out, release=True, discard=lambda: not kept_anything(cfg.out)):
        checkpoint.clean_temporaries(cfg.out)  # left by a run killed mid-save; nobody else writes here now
        train(cfg)
    return 0


def kept_anything(out: str) -> bool:
    """``out`` holds a committed checkpoint or a step line in metrics.jsonl: a result worth keeping."""
    from distrain import checkpoint
    from distrain.trainer.metrics import has_step_lines

    return (Path(out) / checkpoint.MANIFEST).exists() or has_step_lines(Path(out) / "metrics.jsonl")
