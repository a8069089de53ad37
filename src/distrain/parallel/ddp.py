"""Deprecated: ``distrain.parallel.ddp`` is now :mod:`distrain.parallel.data_parallel.ddp`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.data_parallel.ddp import (  # noqa: F401 (re-exported)
    DistributedDataParallel, FIRST_BUCKET_BYTES,
)

__all__ = [
    "DistributedDataParallel", "FIRST_BUCKET_BYTES",
]

warnings.warn(
    "distrain.parallel.ddp is deprecated and will be removed in the next release; "
    "import distrain.parallel.data_parallel.ddp instead",
    DeprecationWarning, stacklevel=2)
