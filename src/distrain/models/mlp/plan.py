"""The MLP's tensor-parallel plan, kept beside the MLP: Linear layers paired column / row.

For ``MLP.layers = [Flatten, Linear, ReLU, Linear, ReLU, ..., Linear]`` the Linear layers
are taken in pairs, as in the seeds' column-then-row example (001, "Tensor Parallelism"):
the first of a pair column-parallel (f on the input, its hidden units sharded; ReLU works on
the shard), the second row-parallel (partial sums, g). With an odd count the last Linear is
column-parallel with its output gathered, so the logits (B, num_classes) are replicated and
the plain ``classification_loss`` applies. Every width a Linear splits must be divisible by tp
(``apply_tensor_parallel`` checks each, with the one tp size check, ``check_tp_divides``).
"""

from __future__ import annotations

import torch.nn as nn

from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel import ColwiseParallel, TPPlan

__all__ = ["mlp_tp_plan"]


def mlp_tp_plan(model: nn.Module) -> TPPlan:
    """The plan for ``model`` (an :class:`~distrain.models.MLP`, or any model whose ``layers``
    list holds its Linear layers): {"layers.i": "colwise" | "rowwise" | colwise gathered}."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"mlp_tp_plan: {type(model).__name__} has no `layers` list")
    linear = [i for i, m in enumerate(layers) if isinstance(m, nn.Linear)]
    if not linear:
        raise ConfigError(f"mlp_tp_plan: {type(model).__name__}.layers holds no nn.Linear")
    plan: dict[str, object] = {}
    for j, i in enumerate(linear):
        last = j == len(linear) - 1
        if j % 2 == 0:
            plan[f"layers.{i}"] = ColwiseParallel(gather_output=last)
        else:
            plan[f"layers.{i}"] = "rowwise"
    return TPPlan(plan)
