"""What a model returns, as losses and evaluation read it.

The seam between a model and its loss is ``loss_fn(output, target)``: the loss receives the
output exactly as the model returns it. Models differ in what that is: distrain's return the
logits tensor; Hugging Face's return a ``ModelOutput`` with ``.logits``; others return a tuple
whose first element is the logits. The default losses, accuracy and text sampling read the
tensor through :func:`logits_of`, so all three kinds train and evaluate unchanged.
"""

from __future__ import annotations

import torch


def logits_of(output) -> torch.Tensor:
    """The logits inside a model's ``output``: ``output.logits`` when it has them (Hugging Face's
    ModelOutput), else the first element of a tuple or list, else the output itself (a tensor).
    A TypeError names what came instead."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model returned a {type(output).__name__}, which has no logits: return a tensor, an "
                    f"object with .logits, or a tuple whose first element is the logits, or give a loss_fn that "
                    f"takes your model's output as it is")
