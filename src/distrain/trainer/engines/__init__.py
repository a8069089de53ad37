"""Engines: one class per role in training, chosen by strategy (see base.py for the contract).

    grid.py       every data-parallel and model-parallel layout: ddp and zero1-3, alone or on the
                  dp × cp × tp × pp grid with --ep (parallelize(), one Topology)
    single.py     one process
    ps.py         parameter server: workers train, servers serve (ps-sync, ps-async)
    diloco.py     DiLoCo: islands of data-parallel ranks, an outer step every --inner-steps steps
    diloco_grid.py  DiLoCo whose islands are grids (--tp/--pp/--inner-strategy): the grid engine's step
                  inside each island, the outer step on this rank's shard across the islands
    baselines.py  what benchmarks compare with: torch's DDP (torch-ddp), and local, the same ranks
                  with no gradient exchange (a step's floor)

A new way of data or model parallelism belongs in ``parallelize()`` (distrain.parallel), which the
grid engine applies; a new role (another kind of process) is one file here plus one line in ``ENGINES``.
"""

from __future__ import annotations

import importlib

from distrain.trainer.engines.base import Engine

GRID = "distrain.trainer.engines.grid:GridEngine"
# strategy -> "module:class" (imported on use, so reading the list imports no parallel code)
ENGINES = {
    "single": "distrain.trainer.engines.single:SingleEngine",
    "ddp": GRID,
    **{f"zero{s}": GRID for s in (1, 2, 3)},
    "ps-sync": "distrain.trainer.engines.ps:PSEngine",
    "ps-async": "distrain.trainer.engines.ps:PSEngine",
    "diloco": "distrain.trainer.engines.diloco:DiLoCoEngine",
    "torch-ddp": "distrain.trainer.engines.baselines:TorchDDPEngine",
    "local": "distrain.trainer.engines.baselines:LocalEngine",
}


# --strategy diloco whose islands are grids (--tp/--pp/--inner-strategy: cfg.island_grid)
DILOCO_GRID = "distrain.trainer.engines.diloco_grid:DiLoCoGridEngine"


def engine_class(cfg) -> type[Engine]:
    module, name = (DILOCO_GRID if getattr(cfg, "island_grid", False) else ENGINES[cfg.strategy]).split(":")
    return getattr(importlib.import_module(module), name)


def build_engine(cfg, model, loss_fn, optimizer_factory) -> Engine:
    """The engine of ``cfg`` on this rank (every rank of the world calls it)."""
    return engine_class(cfg)(cfg, model, loss_fn, optimizer_factory)


__all__ = ["ENGINES", "Engine", "build_engine", "engine_class"]
