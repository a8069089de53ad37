"""Deprecated: ``distrain.comm.transport`` is now :mod:`distrain.comm.transports`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.comm.transports import (  # noqa: F401 (re-exported)
    TorchTransport, Transport, Work,
)

__all__ = [
    "TorchTransport", "Transport", "Work",
]

warnings.warn(
    "distrain.comm.transport is deprecated and will be removed in the next release; "
    "import distrain.comm.transports instead",
    DeprecationWarning, stacklevel=2)


# old names that live elsewhere now (named, not imported: a shim imports only its new module)
_MOVED = {
    "DEFAULT_TRANSPORT": "distrain.comm.set_default_transport (per group now)",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
