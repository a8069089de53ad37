"""Engines: one small class per way of training, chosen by name (see base.py for the contract).

    single.py          one process
    ddp.py             data parallel by all-reduce: ours (ddp) and torch's (torch-ddp); local,
                       the same ranks with no gradient exchange (a benchmark's floor)
    model_parallel.py  dp × tp × pp (``--tp``/``--pp`` > 1)
    ps.py              parameter server: workers train, servers serve (ps-sync, ps-async)
    zero.py            ZeRO stages 1-3 (zero1, zero2, zero3)

Adding a way of training is one file here plus one line in ``ENGINES``.
"""

from __future__ import annotations

import importlib

from distrain.trainer.engines.base import Engine

# strategy -> "module:class" (imported on use, so reading the list imports no parallel code)
ENGINES = {
    "single": "distrain.trainer.engines.single:SingleEngine",
    "ddp": "distrain.trainer.engines.ddp:DDPEngine",
    "torch-ddp": "distrain.trainer.engines.ddp:TorchDDPEngine",
    "local": "distrain.trainer.engines.ddp:LocalEngine",
    "ps-sync": "distrain.trainer.engines.ps:PSEngine",
    "ps-async": "distrain.trainer.engines.ps:PSEngine",
    **{f"zero{s}": "distrain.trainer.engines.zero:ZeroEngine" for s in (1, 2, 3)},
}
# --tp > 1 or --pp > 1 (with --strategy ddp): the dp × tp × pp grid
MODEL_PARALLEL = "distrain.trainer.engines.model_parallel:ModelParallelEngine"


def engine_class(cfg) -> type[Engine]:
    spec = MODEL_PARALLEL if cfg.model_parallel else ENGINES[cfg.strategy]
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(cfg, model, loss_fn, optimizer_factory) -> Engine:
    """The engine of ``cfg`` on this rank (every rank of the world calls it)."""
    return engine_class(cfg)(cfg, model, loss_fn, optimizer_factory)


__all__ = ["ENGINES", "Engine", "build_engine", "engine_class"]
