"""The optimizers a run trains with, by name: what ``--optimizer`` accepts and builds.

``make_optimizer(name, params, lr, weight_decay, momentum)`` is the one place that maps a name to
a torch optimizer; the trainer builds each run's optimizer through it, and ``distrain checkpoint
import`` builds one to learn a fresh optimizer's hyperparameters. Every optimizer here is
elementwise, so its state cut like the parameters continues exactly under any layout
(checkpoint/reshard.py relies on it).
"""

from __future__ import annotations

from typing import Iterable

import torch

OPTIMIZERS = ("adamw", "sgd")
# a run's optimizer settings when none are given (TrainConfig's defaults: --lr, --optimizer, ...)
DEFAULTS = {"lr": 3e-3, "optimizer": "adamw", "weight_decay": 0.0, "momentum": 0.9}


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                   momentum: float = 0.9) -> torch.optim.Optimizer:
    """``name`` (one of OPTIMIZERS) over ``params``: SGD with momentum, or AdamW (torch's defaults otherwise)."""
    params = list(params)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
