"""A plain MLP classifier laid out like the GPT: ``self.layers`` ModuleList and a loop forward.

``layers = [Flatten, Linear, ReLU, Linear, ReLU, ..., Linear]``; the logits are
``(B, num_classes)``; the loss is ``F.cross_entropy`` (:func:`classification_loss`).
Linear layers use PyTorch's default init (deterministic under torch.manual_seed).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.models.outputs import logits_of


class MLP(nn.Module):
    def __init__(self, in_features: int = 784, hidden: Sequence[int] = (1536, 1536, 768), num_classes: int = 10):
        super().__init__()
        hidden = tuple(hidden)
        for name, v in [("in_features", in_features), ("num_classes", num_classes)] + \
                [(f"hidden[{i}]", h) for i, h in enumerate(hidden)]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"MLP: {name} must be a positive int, got {v!r}")
        self.in_features = in_features
        self.hidden = hidden
        self.num_classes = num_classes
        layers: list[nn.Module] = [nn.Flatten()]
        widths = (in_features,) + hidden
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(widths[-1], num_classes))
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def classification_loss(output, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the class scores (B, classes) in ``output`` (models/outputs.py) against targets (B,)."""
    return F.cross_entropy(logits_of(output), targets)
