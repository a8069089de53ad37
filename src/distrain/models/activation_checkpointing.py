"""Activation checkpointing per transformer block (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost").

Without it, backward needs every intermediate activation of every block, kept from the
forward pass. With it, a block keeps only its input: backward re-runs the block's forward to
rebuild its activations, then differentiates them. Memory for activations drops from
O(layers x per-block intermediates) to O(layers x block input + one block's intermediates),
for about one more forward pass of compute.

:func:`checkpoint_blocks` applies it from outside the model, which stays parallelism-agnostic:
it marks nothing in the model's code, changes no parameter name (checkpoints and plans see the
same module tree), and composes with tensor and pipeline parallelism (a block's re-run forward
repeats its tensor-parallel all-reduces on every rank of the group alike). torch's
non-reentrant checkpoint restores the RNG state for the re-run (dropout draws the same mask),
so the results are bitwise those of the run without it.

A block is an entry of ``model.layers`` whose class sets ``checkpointable = True`` (the GPT's
``Block``, the Llama's decoder layer); a model of yours opts in the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from distrain.errors import ConfigError


def checkpoint_blocks(model: nn.Module) -> int:
    """Checkpoint the activations of every block of ``model.layers`` (in place); returns how many.

    The block's ``forward`` is replaced on the instance by one that runs it under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` during training (eval and
    no-grad forwards run it plainly: there is nothing to save)."""
    layers = getattr(model, "layers", None)
    blocks = [m for m in (layers if isinstance(layers, nn.ModuleList) else []) if getattr(m, "checkpointable", False)]
    if not blocks:
        raise ConfigError(f"--activation-checkpointing: {type(model).__name__} has no blocks to checkpoint: it needs "
                          f"model.layers (an nn.ModuleList) with entries whose class sets checkpointable = True "
                          f"(as distrain's GPT and Llama blocks do)")
    for block in blocks:
        if "forward" in vars(block):  # already wrapped: applying twice would re-run twice
            continue
        plain = block.forward

        def forward(*args, _plain=plain, _block=block, **kwargs):
            if _block.training and torch.is_grad_enabled():
                return checkpoint(_plain, *args, use_reentrant=False, **kwargs)
            return _plain(*args, **kwargs)

        block.forward = forward
    return len(blocks)
