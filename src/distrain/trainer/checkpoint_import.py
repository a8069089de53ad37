"""A run folder whose committed checkpoint is given weights: what ``distrain checkpoint import`` writes.

:func:`import_form` is the common end of ``checkpoint import FILE`` (trainer/checkpoint_cli.py) and
``checkpoint import --hf DIR`` (trainer/hf_io.py): it settles the optimizer (the file's state, or a
fresh one from the flags, recorded in the manifest so that ``--resume`` refuses other settings)
and writes the shard and then the manifest atomically (trainer/checkpoint.py) into a new (or
empty) folder; if the manifest cannot be written, the shard goes too.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distrain import runlock
from distrain.errors import ConfigError
from distrain.trainer import checkpoint
from distrain.trainer.checkpoint_read import IMPORT
from distrain.trainer.config import OPTIMIZERS, TrainConfig
from distrain.trainer.task import build_optimizer

OPTIMIZER_FLAGS = ("optimizer", "weight_decay", "momentum")  # what shapes a fresh optimizer (lr: set every step)


# -- the optimizer ------------------------------------------------------------------------------------
def _optimizer(optimizer: str, weight_decay: float = 0.0, momentum: float = 0.9, lr: float = 1e-3):
    """The optimizer ``distrain train`` builds from these settings (trainer/task.build_optimizer),
    over one placeholder parameter: what matters here is its hyperparameters."""
    cfg = TrainConfig(optimizer=optimizer, weight_decay=weight_decay, momentum=momentum, lr=lr)
    return build_optimizer(cfg, [torch.nn.Parameter(torch.zeros(1))])


def fresh_param_groups(optimizer: str, weight_decay: float, momentum: float, lr: float) -> list[dict]:
    """A fresh optimizer's hyperparameters, as a state_dict's ``param_groups`` without ``params``."""
    opt = _optimizer(optimizer, weight_decay, momentum, lr)
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.state_dict()["param_groups"]]


def _complete(groups, optimizer: str) -> bool:
    """Whether ``groups`` carry every hyperparameter ``optimizer`` needs to step (a group without
    AdamW's ``betas`` loads, then fails with KeyError: 'betas' at the first step)."""
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) for g in groups):
        return False
    for g in groups:  # load each into a fresh optimizer, which fills in its optional flags: what is still missing?
        opt = _optimizer(optimizer)
        need = set(opt.param_groups[0])
        try:
            opt.load_state_dict({"state": {}, "param_groups": [dict(g, params=[0])]})
        except Exception:  # noqa: BLE001 -- a malformed group cannot be used
            return False
        if need - set(opt.param_groups[0]):
            return False
    return True


# -- weights -> a run folder ---------------------------------------------------------------------------
def import_form(path, form: dict, out: str | Path, fresh: bool, extra: dict, **given) -> dict:
    """Write ``form`` (checked weights of model ``form["run"]["model"]``) as run folder ``out``'s checkpoint;
    ``fresh``: weights alone; ``extra``: more manifest entries; ``given``: the optimizer flags."""
    model, given = form["run"]["model"], {k: given.get(k) for k in OPTIMIZER_FLAGS}

    saved = dict(form["run"].get("config") or {})
    default = TrainConfig()
    hp = {k: given[k] if given[k] is not None else saved.get(k, getattr(default, k)) for k in given}
    if hp["optimizer"] not in OPTIMIZERS:
        raise ConfigError(f"{IMPORT}: --optimizer {hp['optimizer']!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    for k in ("weight_decay", "momentum"):
        if isinstance(hp[k], bool) or not isinstance(hp[k], (int, float)):
            raise ConfigError(f"{IMPORT}: --{k.replace('_', '-')} must be a number, got {hp[k]!r}")
        hp[k] = float(hp[k])
    fresh = fresh or not _complete((form["optimizer"] or {}).get("param_groups"), hp["optimizer"])
    if fresh:  # the optimizer starts fresh, with the config's hyperparameters (recorded: --resume checks them)
        groups = fresh_param_groups(hp["optimizer"], hp["weight_decay"], hp["momentum"],
                                    float(saved.get("lr", default.lr)))
        form["optimizer"] = {"state": {}, "param_groups": groups}
        saved.update({k: v for k, v in hp.items() if k != "momentum" or hp["optimizer"] == "sgd"})
    else:
        first = form["optimizer"]["param_groups"][0]
        kept = {"optimizer": saved.get("optimizer"), "weight_decay": first.get("weight_decay"),
                "momentum": first.get("momentum")}
        flags = [f"--{k.replace('_', '-')}" for k, v in given.items() if v is not None and v != kept[k]]
        if flags:
            raise ConfigError(f"{IMPORT}: {path} carries its optimizer's state and hyperparameters "
                              f"({saved.get('optimizer', 'its optimizer')}); {flags[0]} applies to a fresh optimizer "
                              f"(model weights alone): leave it out, or import torch.save(ckpt['model'], path)")
    form["run"] = dict(form["run"], model=model, config=saved)

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{IMPORT}: --out {out} is a file; give a new (or empty) folder")
    _refuse_nonempty(out)
    with runlock.hold(out):
        _refuse_nonempty(out)  # again, now that no one else can write it
        step = int(form["step"])
        name = checkpoint.shard_file(step, "full")
        target = checkpoint.save(out / name, form | {"shard": "full"})  # atomic: a temporary, then rename
        try:
            manifest = {"format": checkpoint.FORMAT_VERSION, "step": step, "layout": {"consolidated": True},
                        "files": [name], "sha256": {name: checkpoint.sha256(target)}, "model": model,
                        "strategy": form["run"].get("strategy"), "config": saved, **extra}
            checkpoint.write_manifest(out, manifest)  # atomic, and last: it commits the set
        except BaseException:
            target.unlink(missing_ok=True)  # no shard without its manifest
            raise
    return manifest | {"fresh_optimizer": fresh}


def _refuse_nonempty(out: Path) -> None:
    held = sorted(p.name for p in out.iterdir() if p.name != ".distrain.lock") if out.is_dir() else []
    if held:
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{IMPORT}: --out {out} is not empty ({listed}); import into a new (or empty) folder")
