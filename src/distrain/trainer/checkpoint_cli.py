"""``distrain checkpoint``: a run's sharded checkpoint as one plain file, and back.

    distrain checkpoint consolidate RUN_DIR -o model.pt   # any layout -> one file by parameter name
    distrain checkpoint import model.pt --out RUN_DIR     # one file -> a run folder to --resume --reshard

The file (trainer/reshard.py) loads with ``torch.load(path, weights_only=True)``; its
``"model"`` is the whole model's ``state_dict`` (``model.load_state_dict(ckpt["model"])``),
its ``"optimizer"`` the optimizer state by parameter name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from distrain.errors import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    c = sub.add_parser("consolidate", help="a run's committed checkpoint (any layout) as one plain state_dict file")
    c.add_argument("run", metavar="RUN_DIR", help="the run folder (its checkpoint.json names the set)")
    c.add_argument("-o", "--output", required=True, metavar="FILE", help="where to write the consolidated file")
    i = sub.add_parser("import", help="a consolidated file as a run folder's checkpoint (resume it with --reshard)")
    i.add_argument("file", metavar="FILE", help="a file written by `distrain checkpoint consolidate`")
    i.add_argument("--out", required=True, metavar="RUN_DIR", help="a new (or empty) run folder")


def run(args: argparse.Namespace) -> int:
    from distrain import runlock
    from distrain.trainer import reshard

    if args.action == "consolidate":
        if not Path(args.run).is_dir():
            raise ConfigError(f"distrain checkpoint consolidate: {args.run} is not a run folder (give the --out "
                              f"of a training run)")
        with runlock.hold(args.run):  # no run may commit a new set while we read this one
            form = reshard.save_consolidated(args.run, args.output)
        n = sum(t.numel() for t in form["model"].values())
        print(f"{args.output}: step {form['step']}, {len(form['model'])} tensors ({n:,} elements), from layout "
              f"{form['run']['layout']}")
        return 0
    with runlock.hold(args.out):
        manifest = reshard.import_consolidated(args.file, args.out)
    print(f"{args.out}: checkpoint at step {manifest['step']}; continue it with `distrain train --out {args.out} "
          f"--resume --reshard --model {manifest['model']} ...` in any layout")
    return 0
