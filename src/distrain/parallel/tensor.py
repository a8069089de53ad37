"""Deprecated: ``distrain.parallel.tensor`` is now :mod:`distrain.parallel.tensor_parallel`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.tensor_parallel import (  # noqa: F401 (re-exported)
    BlockAllReduceBytes, ColumnParallelLinear, RowParallelLinear, ShardInfo, TPGroup,
    VocabParallelEmbedding, apply_tensor_parallel, copy_to_tp, gather_from_tp,
    megatron_bytes_per_block, reduce_from_tp, scatter_to_tp, tp_loss, tp_shard_info,
    vocab_parallel_cross_entropy,
)

__all__ = [
    "BlockAllReduceBytes", "ColumnParallelLinear", "RowParallelLinear", "ShardInfo", "TPGroup",
    "VocabParallelEmbedding", "apply_tensor_parallel", "copy_to_tp", "gather_from_tp",
    "megatron_bytes_per_block", "reduce_from_tp", "scatter_to_tp", "tp_loss", "tp_shard_info",
    "vocab_parallel_cross_entropy",
]

warnings.warn(
    "distrain.parallel.tensor is deprecated and will be removed in the next release; "
    "import distrain.parallel.tensor_parallel instead",
    DeprecationWarning, stacklevel=2)


# old names that live elsewhere now (named, not imported: a shim imports only its new module)
_MOVED = {
    "check_tp_sizes": "distrain.models.gpt_plan",
    "tp_all_reduces_per_step": "distrain.models.gpt_plan",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
