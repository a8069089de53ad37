"""``distrain checkpoint``: a run's sharded checkpoint as one plain file, and back.

    distrain checkpoint consolidate RUN_DIR -o model.pt        # any layout -> one file by parameter name
    distrain checkpoint import FILE --out RUN_DIR [--model M]  # a file -> a run folder to --resume --reshard
    distrain checkpoint import --hf HF_DIR -o RUN_DIR          # a Hugging Face Llama folder -> a run folder
    distrain checkpoint export RUN_DIR --hf HF_DIR             # a Llama run -> config.json + model.safetensors

``consolidate`` writes the *consolidated form* (trainer/reshard.py), one file that loads with
``torch.load(path, weights_only=True)``: ``"model"`` is the whole model's ``state_dict``,
``"optimizer"`` the optimizer state by parameter name with its hyperparameters, ``"step"`` and
``"run"`` where it came from.

``import`` accepts that file (the run continues at its step with its optimizer state), or model
weights alone: a plain ``state_dict`` (``torch.save(model.state_dict(), "model.pt")``) or a
``.safetensors`` file. Weights alone start at step 0 with a fresh optimizer whose
hyperparameters come from the config (``--optimizer``, ``--weight-decay``, ``--momentum``, or
``--config run.toml``, as for ``distrain train``), recorded in the manifest so that
``--resume`` refuses a run that trains with other ones. Before anything is written, the
tensors' names and shapes are checked against the model the run trains (``--model``); a
mismatch, or a file that is no checkpoint, is a one-line error naming the file, the tensor
and the fix, and leaves ``--out`` as it was. The shard file and then the manifest are written
atomically (trainer/checkpoint.py); if the manifest cannot be written, the shard goes too.

``--hf`` (both ways) is trainer/hf_io.py: an imported HF model that is no preset is the model
``hf:DIR``, whose config the manifest records (``model_config``; trainer/init_from.py builds it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from distrain.errors import ConfigError

IMPORT = "checkpoint import"
CONSOLIDATE = "checkpoint consolidate"
WHAT_IMPORT_READS = ("give a file written by `distrain checkpoint consolidate`, a torch.save(model.state_dict()) "
                     "file or a .safetensors file")
OPTIMIZER_FLAGS = ("optimizer", "weight_decay", "momentum")  # what shapes a fresh optimizer (lr: set every step)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from distrain.trainer.config import OPTIMIZERS

    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("consolidate", help="a run's committed checkpoint (any layout) as one plain state_dict file")
    c.add_argument("run", metavar="RUN_DIR", help="the run folder (its checkpoint.json names the set)")
    c.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the consolidated file")
    i = sub.add_parser("import", help="a consolidated file, model weights alone, or a Hugging Face Llama folder "
                                      "(--hf) as a run folder's checkpoint (train from it with --init-from)",
                       description="Make a run folder whose checkpoint is FILE (or HF_DIR's weights); continue it "
                                   "with `distrain train --out RUN_DIR --resume --reshard ...` in any layout, or start "
                                   "new runs from it with --init-from. See docs/training.md, docs/llama.md.")
    i.add_argument("file", metavar="FILE", nargs="?",
                   help="a file written by `distrain checkpoint consolidate`, a torch.save(model.state_dict()) file, "
                        "or a .safetensors file")
    i.add_argument("-o", "--out", required=True, metavar="RUN_DIR", help="a new (or empty) run folder")
    i.add_argument("--model", default=None, metavar="MODEL",
                   help="the model the run trains (a preset or PKG.MOD:FACTORY, as for `distrain train`); the "
                        "file's tensors are checked against it. Needed for weights alone (default: the one a "
                        "consolidated file names)")
    i.add_argument("--config", default=None, metavar="RUN.toml",
                   help="the run's settings file: --model, --optimizer, --weight-decay and --momentum are read "
                        "from it (flags given here override it)")
    i.add_argument("--optimizer", default=None, choices=OPTIMIZERS,
                   help="weights alone: the fresh optimizer (default: the train default, adamw)")
    i.add_argument("--weight-decay", type=float, default=None, help="weights alone: its weight decay (default: 0.0)")
    i.add_argument("--momentum", type=float, default=None, help="weights alone: SGD's momentum (default: 0.9)")
    from distrain.trainer import hf_io

    hf_io.add_arguments(sub, i)  # import --hf, export


def run(args: argparse.Namespace) -> int:
    from distrain import runlock
    from distrain.trainer import reshard

    if args.action == "consolidate":
        if not Path(args.run).is_dir():
            raise ConfigError(f"{CONSOLIDATE}: {args.run} is not a run folder (give the --out of a training run)")
        try:
            with runlock.hold(args.run):  # no run may commit a new set while we read this one
                form = reshard.save_consolidated(args.run, args.output)
        except ConfigError as e:  # the lock's "--out ..." and the checkpoint's "--resume: ..." name this command
            raise ConfigError(reshard.as_command(str(e), CONSOLIDATE)) from None
        n = sum(t.numel() for t in form["model"].values())
        print(f"{args.output}: step {form['step']}, {len(form['model'])} tensors ({n:,} elements), from layout "
              f"{form['run']['layout']}")
        return 0
    if args.action == "export" or args.hf is not None:
        from distrain.trainer import hf_io

        return hf_io.run(args, _settings(args) if args.action == "import" else {})
    if args.file is None:
        raise ConfigError(f"{IMPORT}: give FILE, or --hf HF_DIR for a Hugging Face model folder")
    manifest = import_file(args.file, args.out, **_settings(args))
    opt = manifest["config"]
    fresh = "" if not manifest.get("fresh_optimizer") else (
        f"; the optimizer starts fresh: {opt['optimizer']}, weight decay {opt['weight_decay']}"
        + (f", momentum {opt['momentum']}" if "momentum" in opt else "") + " (train with the same)")
    print(f"{args.out}: checkpoint at step {manifest['step']}{fresh}; continue it with `distrain train --out "
          f"{args.out} --resume --reshard --model {manifest['model']} ...` in any layout")
    return 0


def _settings(args: argparse.Namespace) -> dict:
    """--model/--optimizer/--weight-decay/--momentum: the flags, else --config's file, else None."""
    given = {k: getattr(args, k) for k in ("model",) + OPTIMIZER_FLAGS}
    if args.config is None:
        return given
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError(f"{IMPORT}: --config needs Python >= 3.11 (tomllib); give the settings as flags "
                          f"instead") from None
    try:
        with open(args.config, "rb") as f:
            toml = {k.replace("-", "_"): v for k, v in tomllib.load(f).items()}
    except OSError as e:
        raise ConfigError(f"{IMPORT}: --config {args.config}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{IMPORT}: --config {args.config}: not valid TOML ({e})") from None
    return {k: v if v is not None else toml.get(k) for k, v in given.items()}


# -- reading FILE (trainer/hf_io.py) ------------------------------------------------------------------
def read_file(path: str | Path, who: str = IMPORT, what: str = WHAT_IMPORT_READS) -> tuple[str, dict]:
    """FILE as ``("full", consolidated form)`` or ``("weights", {name: tensor})``; anything else
    is a one-line ConfigError (``who: ...``) saying what the file is and what is read (``what``)."""
    from distrain.trainer.hf_io import read_file as read

    return read(path, who, what)


# -- checking the tensors against the model the run trains ------------------------------------------
def model_state(spec: str) -> tuple[dict[str, torch.Size], dict[str, list[str]]] | None:
    """The state_dict shapes of model ``spec`` (a preset or PKG.MOD:FACTORY) and its tied names
    ({name: the other names of the same parameter}); None for ``custom`` (a model passed from
    Python to ``distrain.train``: nothing here can build it; the resume loads it by name)."""
    from distrain.models import build_model
    from distrain.trainer.config import CUSTOM
    from distrain.trainer.custom import is_spec, load_object

    if spec == CUSTOM:
        return None
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG as it was
        if is_spec(spec):
            model = load_object(spec, "--model")()
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"--model {spec} returned a {type(model).__name__}, not an nn.Module")
        else:
            with torch.device("meta"):  # shapes only: no memory for the weights
                model = build_model(spec)
    return module_state(model)


def module_state(model: torch.nn.Module) -> tuple[dict[str, torch.Size], dict[str, list[str]]]:
    """(state_dict shapes, tied names) of a built model (see :func:`model_state`)."""
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    by_param: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(p), []).append(n)
    tied = {n: [m for m in names if m != n] for names in by_param.values() if len(names) > 1 for n in names}
    return shapes, tied


def check_weights(path, weights: dict[str, torch.Tensor], spec: str, who: str = IMPORT, fix: str | None = None,
                  state=None) -> dict[str, torch.Tensor]:
    """``weights`` with exactly the names and shapes of model ``spec``'s state_dict (or ``state``: what
    :func:`module_state` gives), in its order (a tied parameter saved under one of its names, as
    safetensors does, is filled in under the others), or a one-line ConfigError naming the file, the
    tensor and the fix (``who: ...``)."""
    try:
        got = state if state is not None else model_state(spec)
    except ConfigError as e:  # an unknown preset, a factory that does not import...
        raise ConfigError(f"{who}: {e}") from None
    if got is None:
        return dict(weights)
    shapes, tied = got
    weights = dict(weights)
    for n, others in tied.items():
        if n not in weights:
            twin = next((m for m in others if m in weights), None)
            if twin is not None:
                weights[n] = weights[twin]
    missing = [n for n in shapes if n not in weights]
    extra = [n for n in weights if n not in shapes]
    fix = fix or f"import the file with the --model it was saved from, or a file saved from --model {spec}"
    if extra or missing:
        hint = _prefix_hint(list(weights), list(shapes))
        if extra:
            raise ConfigError(f"{who}: {path} holds tensor {extra[0]!r}, which --model {spec} does not have "
                              f"({len(extra)} such, {len(missing)} of the model's missing); {hint or fix}")
        raise ConfigError(f"{who}: {path} has no tensor {missing[0]!r}, which --model {spec} has ({len(missing)} of "
                          f"its {len(shapes)} missing); {hint or fix}")
    for n, want in shapes.items():
        if tuple(weights[n].shape) != tuple(want):
            raise ConfigError(f"{who}: tensor {n!r} of {path} has shape {tuple(weights[n].shape)}, --model {spec} "
                              f"has {tuple(want)}; {fix}")
    return {n: weights[n] for n in shapes}  # in the model's order (a .safetensors file sorts its names)


def _prefix_hint(names: list[str], want: list[str]) -> str:
    """A wrapper's prefix (DDP's ``module.``, torch.compile's ``_orig_mod.``) on every name: the fix."""
    for prefix in ("module.", "_orig_mod.", "model."):
        if names and all(n.startswith(prefix) for n in names) and {n[len(prefix):] for n in names} == set(want):
            return (f"every name in the file starts with {prefix!r} (saved from a wrapper around the model): save "
                    f"the inner model's state_dict, e.g. torch.save(model.{prefix.rstrip('.')}.state_dict(), path)")
    return ""


# -- the optimizer ------------------------------------------------------------------------------------
def _optimizer(optimizer: str, weight_decay: float = 0.0, momentum: float = 0.9, lr: float = 1e-3):
    """The optimizer ``distrain train`` builds from these settings (trainer/task.build_optimizer),
    over one placeholder parameter: what matters here is its hyperparameters."""
    from distrain.trainer.config import TrainConfig
    from distrain.trainer.task import build_optimizer

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


# -- FILE -> a run folder -----------------------------------------------------------------------------
def import_file(path: str | Path, out: str | Path, model: str | None = None, optimizer: str | None = None,
                weight_decay: float | None = None, momentum: float | None = None) -> dict:
    """Make ``out`` a run folder whose committed checkpoint is FILE ``path`` (see the module
    docstring for what it accepts); ``distrain train --out OUT --resume --reshard`` continues it
    in any layout. Everything is checked before ``out`` is touched. Returns the manifest (with
    ``"fresh_optimizer"``: whether the optimizer starts fresh)."""
    from distrain.trainer.init_from import hf_record, hf_state, is_hf_name
    from distrain.trainer.reshard import FULL

    kind, obj = read_file(path)
    if kind == "weights":
        if model is None:
            raise ConfigError(f"{IMPORT}: {path} holds model weights alone; name the model the run will train with "
                              f"--model (a preset such as gpt-small, or PKG.MOD:FACTORY, as for `distrain train`)")
        form = {"kind": FULL, "step": 0, "model": obj, "optimizer": None,
                "run": {"model": model, "strategy": None, "layout": {"weights": Path(path).name}, "config": {}}}
    else:
        form = {k: v for k, v in obj.items() if k not in ("format", "shard")}
        model = model or form["run"].get("model")
        if model is None:
            raise ConfigError(f"{IMPORT}: {path} does not name its model; name the model the run will train with "
                              f"--model")
    hf = is_hf_name(model)  # hf:DIR (a consolidated file of such a run): its config from DIR
    form["run"] = dict(form["run"], model=model)
    form["model"] = check_weights(path, form["model"], model, state=hf_state(model, IMPORT) if hf else None)
    return import_form(path, form, out, kind == "weights", hf_record(model, IMPORT) if hf else {},
                       optimizer=optimizer, weight_decay=weight_decay, momentum=momentum)


def import_form(path, form: dict, out: str | Path, fresh: bool, extra: dict, **given) -> dict:
    """Write ``form`` (checked weights of model ``form["run"]["model"]``) as run folder ``out``'s checkpoint;
    ``fresh``: weights alone; ``extra``: more manifest entries; ``given``: the optimizer flags."""
    from distrain import runlock
    from distrain.trainer import checkpoint
    from distrain.trainer.config import OPTIMIZERS, TrainConfig

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
