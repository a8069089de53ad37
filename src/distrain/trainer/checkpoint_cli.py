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
This module is the command on top: the file is read by trainer/checkpoint_read.py, checked against
the model by trainer/checkpoint_models.py and written by trainer/checkpoint_import.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distrain import runlock
from distrain.errors import ConfigError
from distrain.trainer import hf_io, reshard
from distrain.trainer.checkpoint_import import OPTIMIZER_FLAGS, import_form
from distrain.trainer.checkpoint_models import check_weights, hf_record, hf_state, is_hf_name
from distrain.trainer.checkpoint_read import IMPORT, read_file
from distrain.trainer.config import OPTIMIZERS
from distrain.trainer.reshard import FULL

CONSOLIDATE = "checkpoint consolidate"


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    hf_io.add_arguments(sub, i)  # import --hf, export


def run(args: argparse.Namespace) -> int:
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


# -- FILE -> a run folder -----------------------------------------------------------------------------
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
