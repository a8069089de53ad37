"""``distrain bench comm --predict``: the cost model's time beside every measured one.

Inside the benchmark's world (every rank calls :func:`setup`): the placement of the ranks
on nodes is gathered (:func:`distrain.bench.link.calibrate.placement`), and the links are
either read from a calibration file (``--predict PATH``, written by ``distrain bench link
--json PATH``) or calibrated on the spot by a short ping-pong (``--predict`` alone). Rank 0
then adds ``predicted_us`` (and ``predicted_error_pct`` = 100·(predicted - measured) /
measured) and ``fabric`` (the links it used: :func:`describe`) to each record; algorithms the model has no schedule for (native Gloo; scatter,
gather, barrier, star/tree all-gather variants it does not cover) get ``null``.
"""

from __future__ import annotations

from distrain.bench import common
from distrain.bench.link import calibrate
from distrain.costmodel import Fabric, predict
from distrain.costmodel.links import calibrated_fabric, fabric_from_model

# ``--predict`` alone: a short ping-pong over Gloo (the links the model's schedules cross)
QUICK = calibrate.Settings(sizes=(8, 256 << 10, 1 << 20, 4 << 20), warmup=1, iters=5)


def setup(spec: str, rank: int) -> Fabric | None:
    """Collective: every rank of the world must call it. Returns the fabric on rank 0, None elsewhere."""
    where = calibrate.placement()
    if spec == "auto":
        res = calibrate.measure(rank, QUICK)
        return fabric_from_model(res["model"], where) if res is not None else None
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
        r["fabric"] = describe(fabric)


def describe(fabric: Fabric) -> dict:
    """The links a prediction used, in a calibration model's units (``host_GBps`` null unless the
    calibration's shift found every link sharing one machine's capacity; ``handshake`` whether a send
    waited for the receiver's notice; ``fan_in``/``fan_out`` the fan's efficiencies, empty without one):
    enough to rebuild it."""
    def link(ln):
        return {"alpha_us": ln.alpha * 1e6, "bandwidth_GBps": ln.bandwidth / 1e9}

    return {"inter": link(fabric.inter), "intra": link(fabric.intra), "gamma_ns_per_byte": fabric.gamma * 1e9,
            "host_GBps": None if fabric.host is None else fabric.host / 1e9, "handshake": fabric.handshake,
            "fan_sizes": list(fabric.fan_sizes), "fan_in": [list(r) for r in fabric.fan_in],
            "fan_out": [list(r) for r in fabric.fan_out]}


def table(records: list[dict]) -> str:
    rows = [[r["op"], r["algorithm"], str(r["P"]), common.format_size(r["size_bytes"]), f"{r['time_us']:.0f}",
             "-" if r.get("predicted_us") is None else f"{r['predicted_us']:.0f}",
             "-" if r.get("predicted_error_pct") is None else f"{r['predicted_error_pct']:+.1f}%"]
            for r in records if "predicted_us" in r]
    head = ["op", "algorithm", "P", "size", "measured_us", "predicted_us", "error"]
    return common.format_table([("cost model vs measured", head)], rows) if rows else ""


def load(paths: list[str]) -> list[dict]:
    """Records with a prediction from several ``bench comm --predict --json`` files; ``link`` from the file name."""
    import json
    import os

    out = []
    for p in paths:
        with open(p) as f:
            recs = json.load(f)["records"]
        link = os.path.basename(p).split("_")[1] if "_" in os.path.basename(p) else "?"
        out += [dict(r, link=link) for r in recs if "predicted_us" in r]
    return out


def markdown(records: list[dict]) -> str:
    """One row per (link, P, algorithm): measured / predicted ms and error for each size."""
    sizes = sorted({r["size_bytes"] for r in records})
    keys = sorted({(r["link"], r["P"], r["algorithm"]) for r in records})
    cell = {(r["link"], r["P"], r["algorithm"], r["size_bytes"]): r for r in records}
    head = ["link", "P", "algorithm"] + [f"{common.format_size(s)}: meas / pred ms (err)" for s in sizes]
    rows = []
    for k in keys:
        row = list(map(str, k))
        for s in sizes:
            r = cell.get((*k, s))
            if r is None:
                row.append("")
            elif r["predicted_us"] is None:
                row.append(f"{r['time_us'] / 1e3:.1f} / -")
            else:
                row.append(f"{r['time_us'] / 1e3:.1f} / {r['predicted_us'] / 1e3:.1f} ({r['predicted_error_pct']:+.0f}%)")
        rows.append(row)
    return common.markdown_table(head, rows)


def plot_nodes(records: list[dict], size: int, path: str) -> None:
    """Measured (solid) and predicted (dashed) all_reduce time against node count, per algorithm and link."""
    plt = common.require_pyplot()
    fig, axes = plt.subplots(1, len({r["link"] for r in records}), figsize=(11, 4), squeeze=False)
    for ax, link in zip(axes[0], sorted({r["link"] for r in records})):
        for i, alg in enumerate(sorted({r["algorithm"] for r in records})):
            rs = sorted((r for r in records if r["link"] == link and r["algorithm"] == alg and r["size_bytes"] == size),
                        key=lambda r: r["P"])
            if not rs:
                continue
            c = f"C{i}"
            ax.plot([r["P"] for r in rs], [r["time_us"] / 1e3 for r in rs], "o-", color=c, label=f"{alg} measured")
            pr = [r for r in rs if r["predicted_us"] is not None]
            if pr:
                ax.plot([r["P"] for r in pr], [r["predicted_us"] / 1e3 for r in pr], "x--", color=c,
                        label=f"{alg} predicted")
        ax.set_title(f"all_reduce {common.format_size(size)} on {link} links")
        ax.set_xlabel("nodes (1 rank each)")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def repredict(calibration: str, paths: list[str]) -> None:
    """Recompute every record's ``predicted_us`` in ``bench comm --predict --json`` files from
    ``calibration`` with this version of the model (the measured times are kept as they are)."""
    import json

    import torch

    fabric = calibrated_fabric(calibration, [0])  # read once; each record gets its own placement
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        recs = [r for r in data["records"] if "predicted_us" in r]
        for r in recs:
            elem = torch.empty(0, dtype=getattr(torch, r["dtype"])).element_size()
            annotate([r], fabric.with_placement(r["placement"]), elem)
        data["meta"]["repredicted_from"] = calibration
        with open(p, "w") as f:
            json.dump(data, f, indent=1)


def write_table(table_path: str, plot_path: str, size: int, paths: list[str]) -> int:
    """The markdown table of the records in ``paths`` to ``table_path``; measured against predicted by
    node count at ``size`` bytes to ``plot_path`` (``distrain bench predict --table --plot``)."""
    recs = load(paths)
    with open(table_path, "w") as f:
        f.write(markdown(recs) + "\n")
    plot_nodes(recs, size, plot_path)
    return 0
