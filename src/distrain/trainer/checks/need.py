"""The one way a check refuses: :func:`need` raises a one-line ConfigError when its condition fails."""

from __future__ import annotations

from distrain.errors import ConfigError


def need(cond: bool, msg: str) -> None:
    """ConfigError(``msg``) unless ``cond``: ``msg`` names the flag, what is wrong and how to fix it."""
    if not cond:
        raise ConfigError(msg)
