"""Deprecated: ``distrain.parallel.tensor_layers`` is now :mod:`distrain.parallel.tensor_parallel`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.tensor_parallel import (  # noqa: F401 (re-exported)
    ColumnParallelLinear, RowParallelLinear, TPGroup, VocabParallelEmbedding, copy_to_tp,
    gather_from_tp, reduce_from_tp, scatter_to_tp, vocab_parallel_cross_entropy,
)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "TPGroup", "VocabParallelEmbedding",
    "copy_to_tp", "gather_from_tp", "reduce_from_tp", "scatter_to_tp",
    "vocab_parallel_cross_entropy",
]

warnings.warn(
    "distrain.parallel.tensor_layers is deprecated and will be removed in the next release; "
    "import distrain.parallel.tensor_parallel instead",
    DeprecationWarning, stacklevel=2)
