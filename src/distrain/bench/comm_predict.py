"""``distrain bench comm --predict``: the cost model's time beside every measured one.

Inside the benchmark's world (every rank calls :func:`setup`): the placement of the ranks
on nodes is gathered (:func:`distrain.bench.link_bench.placement`), and the links are
either read from a calibration file (``--predict PATH``, written by ``distrain bench link
--json PATH``) or calibrated on the spot by a short ping-pong (``--predict`` alone). Rank 0
then adds ``predicted_us`` (and ``predicted_error_pct`` = 100·(predicted - measured) /
measured) to each record; algorithms the model has no schedule for (native Gloo; scatter,
gather, barrier, star/tree all-gather variants it does not cover) get ``null``.
"""

from __future__ import annotations

from distrain.bench import common, link_bench
from distrain.costmodel import Fabric, predict
from distrain.costmodel.links import calibrated_fabric, fabric_from_model

QUICK = {"sizes": [8, 256 << 10, 1 << 20, 4 << 20], "warmup": 1, "iters": 5}


def setup(spec: str, rank: int) -> Fabric | None:
    """Collective: every rank of the world must call it. Returns the fabric on rank 0, None elsewhere."""
    where = link_bench.placement()
    if spec == "auto":
        res = link_bench._worker(rank, QUICK)
        return fabric_from_model(res["model"], where) if rank == 0 else None
    return calibrated_fabric(spec, where) if rank == 0 else None


def annotate(records: list[dict], fabric: Fabric, dtype_size: int) -> None:
    for r in records:
        pred = None
        if r["op"] != "barrier":
            res = predict(r["op"], r["algorithm"], r["size_bytes"], fabric, elem=dtype_size)
            pred = None if res is None else res.seconds * 1e6
        r["predicted_us"] = pred
        r["predicted_error_pct"] = None if pred is None else 100.0 * (pred - r["time_us"]) / r["time_us"]
        r["placement"] = list(fabric.placement)


def table(records: list[dict]) -> str:
    rows = [[r["op"], r["algorithm"], str(r["P"]), common.format_size(r["size_bytes"]), f"{r['time_us']:.0f}",
             "-" if r.get("predicted_us") is None else f"{r['predicted_us']:.0f}",
             "-" if r.get("predicted_error_pct") is None else f"{r['predicted_error_pct']:+.1f}%"]
            for r in records if "predicted_us" in r]
    head = ["op", "algorithm", "P", "size", "measured_us", "predicted_us", "error"]
    return common.format_table([("cost model vs measured", head)], rows) if rows else ""
