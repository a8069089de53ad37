"""Deprecated: ``distrain.parallel.ps_layout`` is now
:mod:`distrain.parallel.parameter_server.ps_layout`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.parameter_server.ps_layout import (  # noqa: F401 (re-exported)
    PSLayout, expected_ps_bytes,
)

__all__ = [
    "PSLayout", "expected_ps_bytes",
]

warnings.warn(
    "distrain.parallel.ps_layout is deprecated and will be removed in the next release; "
    "import distrain.parallel.parameter_server.ps_layout instead",
    DeprecationWarning, stacklevel=2)
