"""Your own model, data and loss, from Python or from the command line.

Python::

    import distrain
    from distrain.trainer import TrainConfig

    if __name__ == "__main__":                 # every rank imports this file
        distrain.train(model=MyNet(), train_data=my_train_set, val_data=my_val_set,
                       loss_fn=torch.nn.functional.cross_entropy,
                       config=TrainConfig(strategy="ddp", nproc=2, steps=100, out="runs/mine"))

Command line (``package.module:name`` specs, imported in every rank)::

    distrain train --model mypkg.nets:make_net --data mypkg.sets:make_data --loss cross-entropy

A model factory takes no arguments and returns an ``nn.Module`` (every rank calls it after
seeding with ``--seed``, so every rank builds the same weights); a data factory returns
``(train, val)``. A data set is either map-style (``len(ds)``, ``ds[i] -> (x, y)``, like a
``torch.utils.data.Dataset``; items are stacked into batches) or has
``get_batch(indices) -> (x, y)``. Tensor parallelism needs ``model.tp_plan``; a pipeline
needs ``model.layers`` (an ``nn.ModuleList`` run in order).
"""

from __future__ import annotations

import copy
import dataclasses
import io
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from distrain.errors import ConfigError
from distrain.factories import CUSTOM, is_spec, load_object  # noqa: F401 (is_spec: re-exported)
from distrain.models.outputs import logits_of

LOSSES = ("auto", "cross-entropy", "mse")


class MapDatasetBatches:
    """``get_batch(idx)`` over a map-style data set: stacks ``ds[i] = (x, y)`` for i in idx."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds)

    def get_batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*(self.ds[int(i)] for i in idx))
        return torch.stack([torch.as_tensor(x) for x in xs]), torch.stack([torch.as_tensor(y) for y in ys])


def as_batches(ds, what: str):
    if ds is None or hasattr(ds, "get_batch"):
        return ds
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise ConfigError(f"{what}: {type(ds).__name__} is not a data set: give len() and ds[i] -> (x, y), "
                          f"or get_batch(indices) -> (x, y)")
    return MapDatasetBatches(ds)


def builtin_loss(name: str) -> Callable:
    """``--loss cross-entropy|mse``; both read the model's output through models.logits_of (a
    tensor, ``.logits``, or a tuple's first element)."""
    return {"cross-entropy": _cross_entropy, "mse": _mse}[name]


def _cross_entropy(output, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: logits (..., C), integer targets (...)."""
    logits = logits_of(output)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _mse(output, targets: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits_of(output), targets)


class ModelBytes:
    """A model passed from Python, serialized once in the caller (``torch.save`` of the module).

    Why: handing an ``nn.Module`` to spawned ranks through multiprocessing pickles it with
    torch's reducers, which move every tensor into shared memory: every rank's optimizer would
    then update one storage, shared with the caller's model (P updates per step, with races).
    Bytes carry no storage, so each rank builds its own copy from them (:meth:`load`)."""

    def __init__(self, model: nn.Module):
        buf = io.BytesIO()
        try:
            torch.save(model, buf)
        except Exception as e:  # noqa: BLE001 -- pickling errors come in many types
            raise ConfigError(f"model: cannot serialize your {type(model).__name__} to hand it to the ranks ({e}); "
                              f"define its class at module level (each rank imports it), or pass a factory "
                              f"with --model PKG.MOD:FACTORY") from None
        self.data = buf.getvalue()
        self.type_name = type(model).__name__

    def load(self) -> nn.Module:
        # weights_only=False: a whole module is a pickled object graph (the caller's own, not foreign data)
        return torch.load(io.BytesIO(self.data), map_location="cpu", weights_only=False)


def own_model(model: "nn.Module | ModelBytes") -> nn.Module:
    """This rank's own copy of a model passed from Python: nothing its optimizer updates is
    shared with another rank or with the caller (whose model stays as it was)."""
    return model.load() if isinstance(model, ModelBytes) else copy.deepcopy(model)


@dataclass
class UserParts:
    """What the user brings instead of distrain's presets (None: the preset from the config).

    Ownership: ``model`` is copied, once per rank (:func:`own_model`); the data sets and the
    loss function are shared read-only (spawned ranks map the caller's tensors from shared
    memory, no copy per rank): the trainer only reads them (batches are gathered into new
    tensors), so a rank never writes to the caller's data."""

    model: "nn.Module | ModelBytes | None" = None
    train_data: object = None
    val_data: object = None
    loss_fn: Callable | None = None

    def for_ranks(self) -> "UserParts":
        """These parts as spawned ranks receive them: the model as bytes (see ModelBytes)."""
        model = ModelBytes(self.model) if isinstance(self.model, nn.Module) else self.model
        return UserParts(model, self.train_data, self.val_data, self.loss_fn)

    @classmethod
    def from_config(cls, cfg) -> "UserParts":
        """The parts the config names by ``package.module:name`` spec (built in this rank; an ``hf:DIR``
        model is no spec: checkpoint/init_from.py builds it)."""
        from distrain.checkpoint.models import is_hf_name

        if is_hf_name(cfg.model):
            cfg = dataclasses.replace(cfg, model=CUSTOM)
        parts = cls()
        if is_spec(cfg.model):
            parts.model = load_object(cfg.model, "--model")()
            if not isinstance(parts.model, nn.Module):
                raise ConfigError(f"--model {cfg.model} returned a {type(parts.model).__name__}, not an nn.Module")
        if is_spec(cfg.data):
            got = load_object(cfg.data, "--data")()
            if not (isinstance(got, (tuple, list)) and len(got) == 2):
                raise ConfigError(f"--data {cfg.data} must return (train, val) data sets, got {type(got).__name__}")
            parts.train_data, parts.val_data = (as_batches(d, f"--data {cfg.data}") for d in got)
        if is_spec(cfg.loss):
            parts.loss_fn = load_object(cfg.loss, "--loss")
        elif cfg.loss != "auto":
            parts.loss_fn = builtin_loss(cfg.loss)
        return parts
