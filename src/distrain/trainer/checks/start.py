"""What a run starts from: --init-from (a new run from a checkpoint's weights), --resume and --reshard."""

from __future__ import annotations

import os

from distrain.trainer.checks.need import need


def check_start(cfg) -> None:
    """--init-from and --resume exclude each other; --init-from names an existing file or folder; a
    model is known (given, or recorded by the checkpoint: checkpoint/init_from.py resolves it first);
    --resume takes no value or auto; --reshard needs --resume."""
    if cfg.init_from or cfg.model is None:
        need(cfg.resume is not True, "--init-from starts a new run from a checkpoint's weights (step 0, a fresh "
                                     "optimizer); --resume continues --out's own run exactly: give one of them "
                                     "(--resume auto continues a restarted job's own run once it has a checkpoint)")
        need(not cfg.init_from or os.path.exists(cfg.init_from),
             f"--init-from {cfg.init_from}: no such file or folder; give a Hugging Face model folder, a run "
             f"folder or a checkpoint file")
        need(cfg.model is not None, "--model: none given; name the model, or give --init-from a checkpoint "
                                    "that records it")


def check_resume(cfg) -> None:
    need(cfg.resume in (True, False, "auto"), f"--resume takes no value, or auto; got {cfg.resume!r}")
    need(not cfg.reshard or cfg.resume, "--reshard loads a checkpoint into another layout: it needs --resume "
                                        "(or --resume auto)")
