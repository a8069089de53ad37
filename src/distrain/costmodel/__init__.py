"""The cost model: predicted time of collectives, parameter servers and training steps.

* :mod:`~distrain.costmodel.links`: links, placements, presets and calibrated fabrics;
* :mod:`~distrain.costmodel.sim`: the flow-level α-β simulator (links shared max-min fairly);
* :mod:`~distrain.costmodel.schedules`: the message schedules of star, ring, tree and the PS;
* :func:`predict`: one collective × algorithm × placement -> seconds (None where the
  algorithm's schedule is not modelled: native Gloo, and scatter/gather/barrier);
* :mod:`~distrain.costmodel.collectives`: ring collectives in closed form (the coarse path), and
  NCCL's rings on a GPU cluster;
* :mod:`~distrain.costmodel.plan`: ``distrain plan`` on emulated nodes (DDP, PS, dp×tp×pp);
* a cluster of devices: :mod:`~distrain.costmodel.devices` (specs and kernel efficiencies),
  :mod:`~distrain.costmodel.shapes` (parameters and model FLOPs of a transformer),
  :mod:`~distrain.costmodel.kernels` (compute time), :mod:`~distrain.costmodel.memory` (bytes per
  device), :mod:`~distrain.costmodel.step` (a layout's step time), :mod:`~distrain.costmodel.layouts`
  (every layout ranked), :mod:`~distrain.costmodel.calibration` (the sustained efficiencies, fitted
  on published runs) and :mod:`~distrain.costmodel.validation` (published runs against the planner).

The sizes follow ``distrain bench comm`` (nccl-tests): ``size_bytes`` is the full buffer
(all_reduce/broadcast/reduce: the tensor; all_gather/reduce_scatter: P times a rank's part).
See docs/cost_model.md for the formulas, the calibration and the measured error.
"""

from __future__ import annotations

from distrain.costmodel.links import INTRA, LINKS, Fabric, Link, block_placement, calibrated_fabric, preset_fabric
from distrain.costmodel.schedules import BUILDERS, parameter_server
from distrain.costmodel.sim import Message, SimResult, simulate

__all__ = ["Fabric", "Link", "LINKS", "INTRA", "Message", "SimResult", "block_placement", "calibrated_fabric",
           "predict", "predict_ps", "preset_fabric", "simulate"]


def predict(collective: str, algorithm: str, size_bytes: int, fabric: Fabric, elem: int = 4) -> SimResult | None:
    """Predicted time of one call on ``fabric`` (all of its ranks), or None if not modelled."""
    P = fabric.size
    if P == 1:
        return SimResult(0.0, [])
    builder = BUILDERS.get(algorithm)
    if builder is None:
        return None
    per_rank = collective in ("all_gather", "reduce_scatter")
    count = size_bytes // elem // (P if per_rank else 1)
    if count < 1:
        return None
    built = builder(collective, P, count, elem, fabric.gamma)
    if built is None:
        return None
    msgs, tail = built
    return simulate(msgs, fabric, tail)


def predict_ps(size_bytes: int, servers: int, fabric: Fabric) -> SimResult:
    """Predicted time of one synchronous parameter-server round (pull + push + server update)."""
    msgs, tail = parameter_server(fabric.size, servers, size_bytes, fabric.gamma)
    return simulate(msgs, fabric, tail)
