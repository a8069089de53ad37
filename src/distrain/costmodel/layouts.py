"""Every layout of a model on a cluster, predicted, ranked, and the best one explained.

:func:`candidates` enumerates dp x tp x pp x cp (x ep for a mixture of experts) over the
cluster's devices, with tp inside a node and dividing the heads, pp dividing the layers, cp
cutting the sequence into 2·cp chunks (load-balanced causal attention), and for each the ZeRO
stage (3 only without a pipeline), the micro-batch (dividing each replica's batch), the
recomputation (none, selective, full) and, with a pipeline, 1 or 2 interleaved chunks per
stage. Flags the user gives fix their field. :func:`rank` predicts each
(:func:`distrain.costmodel.step.predict`), drops those whose memory does not fit the device,
and sorts the rest by step time; :func:`explain` says in one line why the first one wins.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from distrain.costmodel.kernels import RECOMPUTE
from distrain.costmodel.step import Case, Layout, Prediction
from distrain.costmodel.table import Row, format_table
from distrain.errors import ConfigError

SEARCH = dict(tp=(1, 2, 4, 8, 16), pp=(1, 2, 4, 8, 16, 32), cp=(1, 2, 4, 8), micro_batch=(1, 2, 4, 8, 16),
              zero=(0, 1, 2, 3), recompute=("none", "selective", "full"), vpp=(1, 2))


def candidates(case: Case, fixed: dict) -> list[Layout]:
    """Valid layouts of ``case.shape`` on ``case.cluster``; ``fixed`` maps Layout fields to values."""
    shape, cl, B, s = case.shape, case.cluster, case.batch, case.seq
    P, G = cl.size, cl.per_node
    pick = lambda name, default: (fixed[name],) if name in fixed else default  # noqa: E731
    out = []
    for tp in pick("tp", SEARCH["tp"]):
        if (tp > G and tp % G) or (tp <= G and G % tp) or shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp, cp in itertools.product(pick("pp", SEARCH["pp"]), pick("cp", SEARCH["cp"])):
            if P % (tp * pp * cp) or shape.layers % pp or (cp > 1 and s % (2 * cp)):
                continue
            dp = P // (tp * pp * cp)
            if ("dp" in fixed and fixed["dp"] != dp) or B % dp:
                continue
            eps = pick("ep", tuple(e for e in (1, 2, 4, 8, 16, 32, 64)
                                   if e == 1 or (shape.moe and shape.experts % e == 0 and (dp * cp * tp) % e == 0)))
            for ep, mb, zero, rc, vpp in itertools.product(
                    eps, pick("micro_batch", SEARCH["micro_batch"]), pick("zero", SEARCH["zero"]),
                    pick("recompute", SEARCH["recompute"]), pick("vpp", SEARCH["vpp"] if pp > 1 else (1,))):
                m = B // dp // mb if (B // dp) % mb == 0 else 0
                if not m or (zero == 3 and pp > 1) or (vpp > 1 and (shape.layers % (pp * vpp) or m % pp)):
                    continue
                out.append(Layout(dp, tp, pp, cp, ep, zero, mb, rc, vpp, sp=fixed.get("sp", True),
                                  tp_overlap=fixed.get("tp_overlap", False), dp_overlap=fixed.get("dp_overlap", True),
                                  attention=fixed.get("attention", "fa2")))
    return out


def rank(case: Case, fixed: dict, efficiency: str = "sustained") -> tuple[list[Prediction], list[Prediction]]:
    """(layouts that fit, fastest first; layouts that do not fit memory, smallest first)."""
    if "recompute" in fixed and fixed["recompute"] not in RECOMPUTE:
        raise ConfigError(f"--recompute {fixed['recompute']!r}: choose from {', '.join(RECOMPUTE)}")
    fits, too_big = [], []
    for layout in candidates(case, fixed):
        p = replace(case, layout=layout).predict(efficiency)
        (fits if p.fits else too_big).append(p)
    fits.sort(key=lambda p: (float(f"{p.step_s:.6g}"), _complexity(p.layout)))
    too_big.sort(key=lambda p: p.memory.total)
    return fits, too_big


def _complexity(layout: Layout) -> tuple:
    """Among equally fast layouts, the simpler first: fewer parallel dimensions, less sharding and recomputation."""
    return (layout.cp, layout.pp, layout.tp, layout.ep, layout.zero, RECOMPUTE.index(layout.recompute), layout.vpp,
            -layout.micro_batch)


TIE = 0.005  # layouts within 0.5 % of the best count as equally fast

_WHY = {"compute": "more compute per device", "tp_exposed": "tensor-parallel all-reduces it cannot hide",
        "dp_exposed": "gradient and weight traffic it cannot hide", "bubble": "a pipeline bubble",
        "cp_exposed": "context-parallel K/V traffic it cannot hide", "ep": "expert all-to-alls",
        "optimizer": "a larger optimizer step"}


def _costs(p: Prediction) -> dict:
    c = {k: p.parts.get(k, 0.0) for k in _WHY if k != "compute"}
    c["compute"] = p.parts["gemm"] + p.parts["attn"] + p.parts["elem"] - c["bubble"]
    return c


def explain(ranked: list[Prediction], device_memory: float) -> str:
    """One line: the best layout, its numbers, and what the best differently-shaped layout loses."""
    best = ranked[0]
    head = (f"best: {best.layout.name()}: {best.step_s:.3g} s per step, {best.tokens_per_s:,.0f} tokens/s per "
            f"device, MFU {100 * best.mfu:.1f} %, {best.memory.total / 1e9:.1f} of {device_memory / 1e9:.0f} GB")
    shape_of = lambda p: (p.layout.dp, p.layout.tp, p.layout.pp, p.layout.cp, p.layout.ep)  # noqa: E731
    others = [p for p in ranked[1:] if shape_of(p) != shape_of(best)]
    ties = sum(1 for p in others if p.step_s <= best.step_s * (1 + TIE))
    other = next((p for p in others if p.step_s > best.step_s * (1 + TIE)), None)
    if ties:
        head += f" (and {ties} other splits within {100 * TIE:.1f} %: the simplest is shown)"
    if other is None:
        return head + "; no slower parallel layout fits"
    a, b = _costs(best), _costs(other)
    worst = max(_WHY, key=lambda k: b[k] - a[k])
    slower = 100 * (other.step_s / best.step_s - 1)
    return (f"{head}; the best other split ({other.layout.name()}) is {slower:.0f} % slower: "
            f"{_WHY[worst]} (+{b[worst] - a[worst]:.3g} s)")


def format_predictions(preds: list[Prediction], top: int) -> str:
    """The ranking as a text table, rank 1 first (the columns of :mod:`distrain.costmodel.table`): compute is
    the kernels' time on the step's critical path (the bubble's slots and the optimizer included), comm what
    the step spends beyond it (exposed communication)."""
    return format_table([_row(p) for p in preds[:top]])


def _row(p: Prediction) -> Row:
    compute = p.parts["gemm"] + p.parts["attn"] + p.parts["elem"] + p.parts["optimizer"]
    return Row(p.layout.name(), p.step_s, compute, max(0.0, p.step_s - compute), p.tokens_per_s, p.mfu,
               p.busiest_link, p.memory.total, p.busiest_bytes)
