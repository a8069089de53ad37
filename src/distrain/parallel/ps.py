"""Deprecated: ``distrain.parallel.ps`` is now :mod:`distrain.parallel.parameter_server`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.parameter_server import (  # noqa: F401 (re-exported)
    MODES, PSLayout, PSWorker, ParameterServer, expected_ps_bytes,
)

__all__ = [
    "MODES", "PSLayout", "PSWorker", "ParameterServer", "expected_ps_bytes",
]

warnings.warn(
    "distrain.parallel.ps is deprecated and will be removed in the next release; "
    "import distrain.parallel.parameter_server instead",
    DeprecationWarning, stacklevel=2)
