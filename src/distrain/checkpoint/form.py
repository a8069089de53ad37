"""The whole-model form: a model's and its optimizer's state by parameter name, whatever the layout.

One format serves every place that needs the whole state: consolidating a checkpoint set
(checkpoint/reshard.py), resharding into another layout, an elastic job's ZeRO pieces joined in
memory, ZeRO's own ``full_state_dict``/``load_full_state_dict`` (parallel/zero), and the file
``distrain checkpoint consolidate`` writes::

    {"kind": "distrain.full/1",
     "model": {name: tensor},                            # model.load_state_dict(form["model"])
     "optimizer": {"state": {name: {key: value}},        # e.g. exp_avg, exp_avg_sq (param-shaped), step
                   "param_groups": [{hyperparameters, no "params"}]},   (None: weights alone)
     "step": k, "run": {"model", "strategy", "layout", "config"}}      # where it came from, when known

It loads with ``torch.load(path, weights_only=True)``. This module is only the format (torch and
the errors; no process group, no file): it sits low, so parallel/zero can speak it.
"""

from __future__ import annotations

from distrain.errors import ConfigError

FULL = "distrain.full/1"


def whole(model: dict, optimizer: dict | None, **extra) -> dict:
    """The whole-model form of ``model`` ({name: tensor}) and ``optimizer`` ({"state", "param_groups"})."""
    return {"kind": FULL, "model": model, "optimizer": optimizer, **extra}


def is_whole(obj) -> bool:
    return isinstance(obj, dict) and obj.get("kind") == FULL


def check(obj, who: str, fix: str) -> dict:
    """``obj`` if it is the whole-model form, else a one-line ConfigError (``who: ...``, then ``fix``)."""
    if not is_whole(obj):
        kind = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
        raise ConfigError(f"{who}: not a consolidated checkpoint (kind {FULL!r}, got {kind!r}); {fix}")
    return obj
