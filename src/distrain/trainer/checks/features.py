"""Training features against each other and the machine: autocast, the zero-bubble schedule,
activation checkpointing, pipeline timelines, --device cuda."""

from __future__ import annotations

from distrain.trainer.checks.need import need


def check_features(cfg) -> None:
    need(cfg.schedule != "zb-h1" or cfg.autocast == "none",
         f"--schedule zb-h1 defers weight gradients outside autocast's casts: it runs without --autocast "
         f"(got --autocast {cfg.autocast}); use --schedule 1f1b with autocast")
    need(cfg.autocast == "none" or cfg.dtype == "float32",
         f"--autocast {cfg.autocast} needs --dtype float32 (autocast lowers float32 compute), got {cfg.dtype}")
    # ZeRO-3 frees each unit's gathered parameters after its forward and stands saved-tensor
    # hooks in for them; a checkpointed block's re-run forward in backward bypasses both
    need(not (cfg.activation_checkpointing and cfg.strategy == "zero3"),
         "--activation-checkpointing does not combine with --strategy zero3 (ZeRO-3 gathers each block's "
         "parameters only for its own forward and backward, not for a re-run of the forward); use zero2, "
         "or zero3 without it")
    need(not (cfg.trace or cfg.gantt) or cfg.pp > 1,
         f"--trace/--gantt draw a pipeline's timeline: they need --pp >= 2, got --pp {cfg.pp}")


def check_device(cfg) -> None:
    """--device cuda needs a visible CUDA device (the name itself: flags.check_optimization)."""
    if cfg.device == "cuda":
        import torch

        need(torch.cuda.is_available(), "--device cuda: no CUDA device is visible (torch.cuda.is_available() is "
                                        "False; install a CUDA build of torch, see docs/training.md, or use "
                                        "--device cpu)")
