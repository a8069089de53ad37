"""``distrain checkpoint``: a run's sharded checkpoint as one plain file, and back.

    distrain checkpoint consolidate RUN_DIR -o model.pt        # any layout -> one file by parameter name
    distrain checkpoint import FILE --out RUN_DIR [--model M]  # a file -> a run folder to --resume --reshard
    distrain checkpoint import --hf HF_DIR -o RUN_DIR          # a Hugging Face Llama folder -> a run folder
    distrain checkpoint export RUN_DIR --hf HF_DIR             # a Llama run -> config.json + model.safetensors

``consolidate`` writes the *consolidated form* (checkpoint/form.py), one file that loads with
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
atomically (checkpoint/store.py); if the manifest cannot be written, the shard goes too.

This module is the command line only (argument parsing and what it prints); the work is the
checkpoint package's: ``consolidate`` is checkpoint/write.consolidate_file, ``import`` FILE is
checkpoint/write.import_file, ``--hf`` (both ways) checkpoint/hf.py. An imported HF model that is
no preset is the model ``hf:DIR``, whose config the manifest records (``model_config``;
checkpoint/init_from.py builds it).
"""

from __future__ import annotations

import argparse

from distrain.checkpoint.hf import export_hf, import_hf
from distrain.checkpoint.read import ARCH, CONFIG, IMPORT
from distrain.checkpoint.write import OPTIMIZER_FLAGS, consolidate_file, import_file
from distrain.cli.common import read_toml
from distrain.errors import ConfigError
from distrain.optim import OPTIMIZERS


def add_parser(sub) -> None:
    """``distrain checkpoint consolidate|import|export`` on the subparsers ``sub``."""
    p = sub.add_parser("checkpoint", help="a run's sharded checkpoint as one plain state_dict file, and back; "
                                          "Hugging Face Llama folders in and out (--hf)")
    add_arguments(p)
    p.set_defaults(func=run)


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
    add_hf_arguments(sub, i)  # import --hf, export


def add_hf_arguments(sub, imp) -> None:
    """``checkpoint import --hf HF_DIR`` (on parser ``imp``) and ``checkpoint export`` (on subparsers ``sub``)."""
    imp.add_argument("--hf", default=None, metavar="HF_DIR",
                     help="instead of FILE: a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors or "
                          "a sharded index); the model is the one its config.json describes")
    e = sub.add_parser("export", help="a Llama run's committed weights (any layout) as a Hugging Face folder",
                       description="Write config.json, model.safetensors and generation_config.json that "
                                   "transformers' LlamaForCausalLM.from_pretrained(HF_DIR) loads. See docs/llama.md.")
    e.add_argument("run", metavar="RUN_DIR", help="the run folder (llama-tiny, llama-small, or a model from Hugging "
                                                 "Face)")
    e.add_argument("--hf", required=True, metavar="HF_DIR", help="a new (or empty) folder to write")


def run(args: argparse.Namespace) -> int:
    if args.action == "consolidate":
        form = consolidate_file(args.run, args.output)
        n = sum(t.numel() for t in form["model"].values())
        print(f"{args.output}: step {form['step']}, {len(form['model'])} tensors ({n:,} elements), from layout "
              f"{form['run']['layout']}")
        return 0
    if args.action == "export" or args.hf is not None:
        return run_hf(args, _settings(args) if args.action == "import" else {})
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
    toml = {k.replace("-", "_"): v for k, v in read_toml(args.config, prefix=f"{IMPORT}: ").items()}
    return {k: v if v is not None else toml.get(k) for k, v in given.items()}


def run_hf(args, settings: dict) -> int:
    """``checkpoint export`` and ``checkpoint import --hf``."""
    if args.action == "export":
        config = export_hf(args.run, args.hf)
        arch = (config.get("architectures") or [ARCH])[0]  # MixtralForCausalLM for a mixture of experts
        print(f"{args.hf}: {arch} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab "
              f"{config['vocab_size']}, {config['dtype']}); load it with {arch}.from_pretrained({args.hf!r})")
        return 0
    if args.file is not None:
        raise ConfigError(f"{IMPORT}: give FILE or --hf HF_DIR, not both")
    if settings.pop("model") is not None:
        raise ConfigError(f"{IMPORT}: --hf takes the model from {args.hf}/{CONFIG}; leave --model out")
    manifest = import_hf(args.hf, args.out, **settings)
    print(f"{args.out}: {args.hf} as a checkpoint at step 0, model {manifest['model']}; train from it with "
          f"`distrain train --init-from {args.out} --data ... --out NEW_RUN` in any layout")
    return 0
