"""Your own code by name: ``package.module:name`` references (``--model``, ``--data``, ``--loss``).

The command line names a model factory, a data factory or a loss function this way; every rank
imports it (:func:`load_object`). ``CUSTOM`` is the model or data name of parts passed as objects
to ``distrain.train(model=..., train_data=...)``.
"""

from __future__ import annotations

import importlib

from distrain.errors import ConfigError

CUSTOM = "custom"  # model/data given as objects to distrain.train


def is_spec(value) -> bool:
    """A ``package.module:name`` spec (the CLI's way to name your own model, data or loss)."""
    return isinstance(value, str) and ":" in value and not value.startswith(("/", "."))


def load_object(spec: str, flag: str):
    """Import ``package.module:name``; a one-line ConfigError naming ``flag`` if that fails."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{flag} {spec}: cannot import {module_name} ({e}); is it on PYTHONPATH?") from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{flag} {spec}: {module_name} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
