"""A run folder whose committed checkpoint is given weights: what ``distrain checkpoint import`` writes.

:func:`import_file` reads FILE (a file written by ``distrain checkpoint consolidate``, i.e. the
whole-model form, or model weights alone: a plain ``state_dict`` or a ``.safetensors`` file) and
checks its tensors against the model. :func:`import_form` is the common end of ``checkpoint import
FILE`` and ``checkpoint import --hf DIR`` (checkpoint/hf.py): it settles the optimizer (the file's
state, or a fresh one from the flags, recorded in the manifest so that ``--resume`` refuses other
settings) and writes the shard and then the manifest atomically (checkpoint/store.py) into a new
(or empty) folder; if the manifest cannot be written, the shard goes too. :func:`consolidate_file`
is ``distrain checkpoint consolidate``: a run's committed set, any layout, as one such file.
"""

from __future__ import annotations

from pathlib import Path

import torch

from distrain import runlock
from distrain.checkpoint import reshard, store
from distrain.checkpoint.form import whole
from distrain.checkpoint.models import check_weights, hf_record, hf_state, is_hf_name, recorded_model
from distrain.checkpoint.read import IMPORT, read_file
from distrain.errors import ConfigError
from distrain.optim import DEFAULTS, OPTIMIZERS, make_optimizer

OPTIMIZER_FLAGS = ("optimizer", "weight_decay", "momentum")  # what shapes a fresh optimizer (lr: set every step)


# -- the optimizer ------------------------------------------------------------------------------------
def _optimizer(optimizer: str, weight_decay: float = 0.0, momentum: float = 0.9, lr: float = 1e-3):
    """The optimizer ``distrain train`` builds from these settings (distrain.optim), over one
    placeholder parameter: what matters here is its hyperparameters."""
    return make_optimizer(optimizer, [torch.nn.Parameter(torch.zeros(1))], lr, weight_decay, momentum)


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
    hp = {k: given[k] if given[k] is not None else saved.get(k, DEFAULTS[k]) for k in given}
    if hp["optimizer"] not in OPTIMIZERS:
        raise ConfigError(f"{IMPORT}: --optimizer {hp['optimizer']!r} is unknown; use one of {', '.join(OPTIMIZERS)}")
    for k in ("weight_decay", "momentum"):
        if isinstance(hp[k], bool) or not isinstance(hp[k], (int, float)):
            raise ConfigError(f"{IMPORT}: --{k.replace('_', '-')} must be a number, got {hp[k]!r}")
        hp[k] = float(hp[k])
    fresh = fresh or not _complete((form["optimizer"] or {}).get("param_groups"), hp["optimizer"])
    if fresh:  # the optimizer starts fresh, with the config's hyperparameters (recorded: --resume checks them)
        groups = fresh_param_groups(hp["optimizer"], hp["weight_decay"], hp["momentum"],
                                    float(saved.get("lr", DEFAULTS["lr"])))
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
        name = store.shard_file(step, "full")
        target = store.save(out / name, form | {"shard": "full"})  # atomic: a temporary, then rename
        try:
            manifest = {"format": store.FORMAT_VERSION, "step": step, "layout": {"consolidated": True},
                        "files": [name], "sha256": {name: store.sha256(target)}, "model": model,
                        "strategy": form["run"].get("strategy"), "config": saved, **extra}
            store.write_manifest(out, manifest)  # atomic, and last: it commits the set
        except BaseException:
            target.unlink(missing_ok=True)  # no shard without its manifest
            raise
    return manifest | {"fresh_optimizer": fresh}


def _refuse_nonempty(out: Path) -> None:
    held = sorted(p.name for p in out.iterdir() if p.name != ".distrain.lock") if out.is_dir() else []
    if held:
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"{IMPORT}: --out {out} is not empty ({listed}); import into a new (or empty) folder")


# -- FILE -> a run folder, and back ---------------------------------------------------------------------
def import_file(path: str | Path, out: str | Path, model: str | None = None, optimizer: str | None = None,
                weight_decay: float | None = None, momentum: float | None = None) -> dict:
    """Make ``out`` a run folder whose committed checkpoint is FILE ``path`` (see the module
    docstring for what it accepts); ``distrain train --out OUT --resume --reshard`` continues it
    in any layout. Everything is checked before ``out`` is touched. Returns the manifest (with
    ``"fresh_optimizer"``: whether the optimizer starts fresh)."""
    kind, obj = read_file(path)
    if kind == "weights":
        if model is None:
            raise ConfigError(f"{IMPORT}: {path} holds model weights alone; name the model the run will train with "
                              f"--model (a preset such as gpt-small, or PKG.MOD:FACTORY, as for `distrain train`)")
        form = whole(obj, None, step=0,
                     run={"model": model, "strategy": None, "layout": {"weights": Path(path).name}, "config": {}})
    else:
        form = {k: v for k, v in obj.items() if k not in ("format", "shard")}
        model = model or recorded_model(form["run"].get("model"), f"{IMPORT}: {path}", "import")  # (no factory)
        if model is None:
            raise ConfigError(f"{IMPORT}: {path} does not name its model; name the model the run will train with "
                              f"--model")
    hf = is_hf_name(model)  # hf:DIR (a consolidated file of such a run): its config from DIR
    form["run"] = dict(form["run"], model=model)
    form["model"] = check_weights(path, form["model"], model, state=hf_state(model, IMPORT) if hf else None)
    return import_form(path, form, out, kind == "weights", hf_record(model, IMPORT) if hf else {},
                       optimizer=optimizer, weight_decay=weight_decay, momentum=momentum)


CONSOLIDATE = "checkpoint consolidate"


def consolidate_file(run: str | Path, output: str | Path) -> dict:
    """``distrain checkpoint consolidate RUN -o FILE``: run folder ``run``'s committed set (any layout) as
    one file of the whole-model form, written atomically while no run may commit a new set; returns the form.
    Errors name this command (the checks are --resume's)."""
    if not Path(run).is_dir():
        raise ConfigError(f"{CONSOLIDATE}: {run} is not a run folder (give the --out of a training run)")
    try:
        with runlock.hold(run):  # no run may commit a new set while we read this one
            return reshard.save_consolidated(run, output)
    except ConfigError as e:  # the lock's "--out ..." and the checkpoint's "--resume: ..." name this command
        raise ConfigError(reshard.as_command(str(e), CONSOLIDATE)) from None
