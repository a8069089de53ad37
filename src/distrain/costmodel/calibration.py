"""The sustained efficiencies: three time multipliers per chip, fitted on published runs.

The nominal efficiencies of :mod:`distrain.costmodel.devices` come from kernel benchmarks
(MAMF, FlashAttention's papers, STREAM-like copies). A training step reaches less: clocks
under a sustained load, matmul shapes other than the benchmark's best, eager element-wise
kernels that move more bytes than the minimum :mod:`distrain.costmodel.kernels` counts. Like the
trace-driven predictors (Proteus, Lumos, vTrain) that time kernels on the real system, the
planner takes that gap from measurements, here published ones: for every run of the calibration
set it splits the predicted step at nominal efficiency into matmul (G), attention (A) and
element-wise (E) seconds plus the rest (R: exposed communication, the optimizer), and fits
``published step ≈ x_g·G + x_a·A + x_e·E + R`` by non-negative least squares on relative errors,
one (x_g, x_a, x_e) per chip family (Lawson & Hanson's NNLS, ``scipy.optimize.nnls``).

The calibration set is MosaicML's llm-foundry benchmark table (``scripts/train/benchmarking/
README.md`` at commit 4952183, 2024-04-22; its 209 bf16 rows copied to
docs/cost_model_data/mosaicml_benchmarks.csv) minus the rows the validation uses (sequence
length 2048 on 8 GPUs, :func:`held_out`) and minus the H100 rows on more than one node (their
network is not stated; the A100 tables state 1600 Gb/s RoCE per node: ``roce-200g`` per GPU).
The validation's other sources (Megatron-LM, torchtitan) are not in it. The result is
``devices.SUSTAINED``; tests check that a re-fit reproduces it.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass

from distrain.costmodel.devices import Device, device
from distrain.costmodel.links import INTRA, LINKS
from distrain.costmodel.shapes import preset_shape, with_positions
from distrain.costmodel.step import Case, Cluster, Layout, predict
from distrain.errors import ConfigError

GPUS = {"h100_80gb": "h100", "a100_80gb": "a100-80g", "a100_40gb": "a100-40g"}


@dataclass(frozen=True)
class Run:
    case: Case
    tokens_per_s_per_device: float
    label: str


def mosaicml_runs(path: str) -> list[Run]:
    """Every row of the MosaicML table as a planner case (FSDP over all GPUs, 8 per node)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        raise ConfigError(f"calibration data {path!r}: cannot read it ({e.strerror})") from None
    out = []
    for r in rows:
        gpus, seq = int(r["gpus"]), int(r["seq"])
        dev = device(GPUS[r["gpu"]])
        link = "roce-200g" if dev.family == "ampere" else "ib-400g"  # H100: single-node rows only (held_out)
        cluster = Cluster(dev, max(1, gpus // 8), min(8, gpus), LINKS[link], INTRA[dev.intra])
        layout = Layout(dp=gpus, zero=3 if r["sharding"] == "FULL_SHARD" else 2, micro_batch=int(r["micro_batch"]),
                        recompute="full" if r["activation_checkpointing"] == "True" else "none", attention="fa2")
        case = Case(with_positions(preset_shape(r["model"]), seq), cluster, layout, int(r["global_batch"]), seq)
        out.append(Run(case, float(r["tokens_per_s_per_gpu"]), f"{r['gpu']} {r['model']} s{seq} x{gpus}"))
    return out


def held_out(run: Run) -> bool:
    """Rows the calibration leaves out: the validation's (sequence 2048, one node of 8) and the
    multi-node H100 ones (network not stated)."""
    c = run.case
    return (c.seq == 2048 and c.cluster.size == 8) or (c.cluster.device.family == "hopper" and c.cluster.nodes > 1)


def fit(runs: list[Run]) -> dict[str, tuple[float, float, float]]:
    """(x_g, x_a, x_e) per chip family from ``runs`` (NNLS on relative step-time errors)."""
    import numpy as np
    from scipy.optimize import nnls

    rows: dict[str, tuple[list, list]] = {}
    for run in runs:
        c = run.case
        p = predict(c.shape, c.cluster, c.layout, c.batch, c.seq)
        step = c.batch * c.seq / (run.tokens_per_s_per_device * c.cluster.size)
        G, A, E = p.parts["gemm"], p.parts["attn"], p.parts["elem"]
        a, b = rows.setdefault(c.cluster.device.family, ([], []))
        a.append([G / step, A / step, E / step])
        b.append(1.0 - (p.step_s - G - A - E) / step)
    out = {}
    for family, (a, b) in sorted(rows.items()):
        x, _ = nnls(np.array(a), np.array(b))
        out[family] = tuple(round(float(v), 3) for v in x)
    return out


def calibrated_devices(multipliers: dict[str, tuple[float, float, float]]) -> dict[str, Device]:
    """Every preset with ``multipliers`` applied (for a what-if with another fit)."""
    from distrain.costmodel.devices import DEVICES

    return {n: d.sustained(multipliers.get(d.family, (1.0, 1.0, 1.0))) for n, d in DEVICES.items()}


def report(csv_path: str) -> int:
    """Fit the multipliers on the MosaicML rows that the validation does not hold out and print them
    (``distrain plan --fit-efficiency CSV``)."""
    runs = [r for r in mosaicml_runs(csv_path) if not held_out(r)]
    fitted = fit(runs)
    counts = {f: sum(r.case.cluster.device.family == f for r in runs) for f in fitted}
    for family, x in fitted.items():
        print(f"{family}: {counts[family]} runs, multipliers (matmul, attention, element-wise) = {x}")
    return 0
