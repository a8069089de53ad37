"""DiLoCo against DDP on a link: predicted step time, bytes per node per step, and the crossover bandwidth.

The layout is ``distrain train --strategy diloco --islands K`` on K nodes of M ranks each: one island per
node (consecutive ranks, so island i is node i under block placement), P = K·M ranks in all.

* **DDP** over the P ranks: :func:`~distrain.costmodel.plan.plan_ddp`, the emulated planner's model (the
  gradient in DDP's buckets, each bucket's all-reduce overlapped with the rest of backward).
* **DiLoCo with H inner steps**: the inner step is DDP inside the island (the same ``plan_ddp`` on the
  island's M ranks, over the node's intra link; each rank's batch is B/P, as in DDP); every H steps the
  outer step adds the outer all-reduce, not overlapped: each of the M cross groups (place j of every
  island) all-reduces the whole flat Δ (N parameters of 4 bytes, 2 with ``bf16``) over the K nodes, all M
  at once on the nodes' links (:func:`~distrain.costmodel.collectives.ring_time`), and the outer optimizer
  (Δ, the SGD/Nesterov step, the copy back: ``outer`` seconds per parameter, measured on a preset by
  :func:`measure_outer`, 0 with ``--compute-ms``)::

      t_diloco(H) = t_inner + (t_outer_all_reduce + outer · N) / H

* **Bytes per node per step**: what the node's ranks send over its link, counted as distrain's traffic
  ledger counts a rank's bytes (:func:`distrain.comm.algorithms.cost.traffic`: a ring all-reduce of N
  elements on P ranks sends 2(P − 1)/P · N from each rank, exactly, with ``tensor_split``'s uneven
  chunks). DDP: the node's rank whose ring successor is on the next node, over every bucket. DiLoCo:
  every rank of the node (each one's cross-group successor is on another node), once per H steps, so
  divided by H. With one rank per node this is the ledger's ``bytes_sent_per_step`` of that rank; the
  busiest node's figure is given.

**The crossover.** Let b be the inter-node link's bandwidth (payload bytes per second, one direction, every
node with its own link; α, the intra link and γ kept; a calibration's shared-host cap dropped, as the
question is one of a link). DiLoCo with H *pays by a factor f* where t_ddp(b) ≥ f · t_diloco(b), and
:func:`crossover` gives the highest b where that holds: below it DiLoCo's step is at least f times faster.
Where nothing overlaps (one bucket, M = 1) both times are affine in 1/b, t_ddp = C + A_d + V_d / b and
t_diloco = C + (A_o + O + V_o / b) / H (C: compute; A: the latency and add terms of the all-reduce, for a
ring of K equal hops 2(K − 1)α + (K − 1)γ·n/K; V: the bytes on a hop's link times the number of steps,
2(K − 1)/K · n; O = outer · N), so::

      b* = (V_d − f · V_o / H) / ((f − 1) · C + f · (A_o + O) / H − A_d)

and DDP's communication equals its compute at b = V_d / (C − A_d) (:func:`ddp_balance`). The functions
find both on the full model (overlap, pieces, links shared), by bisection on log b to 1e-12 relative,
after a scan from the top of :data:`BANDWIDTHS` down for the highest bandwidth that satisfies it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Callable

from distrain.comm.algorithms.cost import traffic
from distrain.costmodel.collectives import ring_time
from distrain.costmodel.links import Fabric, Link
from distrain.costmodel.plan import Compute, ModelSpec, ddp_buckets, plan_ddp
from distrain.errors import ConfigError
from distrain.parallel.diloco import quantized

PAYS = 2.0  # "DiLoCo pays": its step at least this many times faster than DDP's (its replicas drift for H steps,
# so an equal step time would gain nothing); crossover() takes any factor
BANDWIDTHS = (125.0, 1.25e12)  # bytes/s searched: 1 kbit/s to 10 Tbit/s of payload per node link
ELEM = {None: 4, "bf16": 2}  # bytes per element of the outer all-reduce (float32 parameters)
COMPRESSIONS = (None, "bf16", "int8", "int4")  # --outer-compression: int8/int4 are quantized (not a ring's sum)


@dataclass(frozen=True)
class Row:
    """One strategy's predicted step: seconds (``comm_s``: all communication per step, amortized for DiLoCo's
    outer all-reduce; ``compute_s``: forward+backward, the optimizer and the amortized outer step) and the
    busiest node's bytes sent over its link per step."""
    strategy: str
    step_s: float
    compute_s: float
    comm_s: float
    node_bytes: float


def _ring_bytes(P: int, count: int, elem: int, rank: int) -> int:
    return traffic("all_reduce", "ring", P, rank, count, elem)[0]


def ddp_row(m: ModelSpec, fabric: Fabric, c: Compute, batch: int) -> Row:
    """DDP (ring) over every rank of ``fabric``: the planner's :func:`~distrain.costmodel.plan.plan_ddp`."""
    p = plan_ddp(m, fabric, c, batch, "ring")
    P, pl = fabric.size, fabric.placement
    out = [r for r in range(P) if pl[(r + 1) % P] != pl[r]]  # ranks whose ring successor is on another node
    per_node: dict[int, int] = {}
    for b in ddp_buckets(m):
        for r in out:
            per_node[pl[r]] = per_node.get(pl[r], 0) + _ring_bytes(P, b // 4, 4, r)
    return Row("ddp ring", p.step_s, p.compute_s, p.comm_s, float(max(per_node.values(), default=0)))


def _islands(fabric: Fabric) -> tuple[int, int]:
    """(K nodes, M ranks per node) of a block placement; one island per node."""
    K = len(set(fabric.placement))
    M = fabric.size // K
    if K < 2 or fabric.placement != tuple(r // M for r in range(fabric.size)):
        raise ConfigError(f"DiLoCo: plan needs at least 2 nodes with equal ranks each (one island per node), "
                          f"got {K} node(s); give --nodes 2 or more")
    return K, M


def outer_all_reduce(m: ModelSpec, fabric: Fabric, compression: str | None = None) -> tuple[float, float]:
    """(seconds, the busiest node's bytes sent) of one outer all-reduce: the M cross groups at once, each a ring
    over the K nodes of the flat Δ (N elements of 4 bytes, 2 with bf16; int8/int4: the quantized exchange's
    payload bytes, :func:`distrain.parallel.diloco.quantized.sync_bytes`, at a ring's time)."""
    K, M = _islands(fabric)
    groups = [[i * M + j for i in range(K)] for j in range(M)]
    if compression in quantized.BITS:
        # an all-to-all of the chunks and an all-gather of the mean's (parallel/diloco/quantized.py): each rank
        # sends about what a ring all-reduce of those payloads would, so its time is the ring's on them
        sent = quantized.sync_bytes(m.params, K, quantized.BITS[compression])
        seconds, _ = ring_time(fabric, groups, round(sent * K / (2 * (K - 1))), "all_reduce", 1)
        return seconds, float(M * sent)
    elem = ELEM[compression]
    seconds, _ = ring_time(fabric, groups, m.params * elem, "all_reduce", elem)
    node = M * max(_ring_bytes(K, m.params, elem, i) for i in range(K))  # node i: place i of M cross groups
    return seconds, float(node)


def diloco_row(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, H: int, compression: str | None = None,
               outer: float = 0.0) -> Row:
    """DiLoCo with ``H`` inner steps, one island per node of ``fabric``; ``outer``: the outer step's seconds per
    parameter (besides its all-reduce)."""
    if H < 1:
        raise ConfigError(f"--inner-steps {H}: give H >= 1 inner steps between outer steps")
    K, M = _islands(fabric)
    inner = plan_ddp(m, fabric.with_placement((0,) * M), c, batch / K, "ring")  # each rank: B / K / M samples
    sync_s, sync_bytes = outer_all_reduce(m, fabric, compression)
    name = f"diloco H={H}" + (f" {compression}" if compression else "")
    return Row(name, inner.step_s + (sync_s + outer * m.params) / H, inner.compute_s + outer * m.params / H,
               inner.comm_s + sync_s / H, sync_bytes / H)


def with_bandwidth(fabric: Fabric, bandwidth: float) -> Fabric:
    """``fabric`` with every node's link at ``bandwidth`` (payload bytes/s per direction; α kept), no shared host."""
    return replace(fabric, inter=Link(fabric.inter.alpha, bandwidth, f"{bandwidth * 8 / 1e6:g} Mbit/s"),
                   node_links=None, host=None)


def _highest(holds: Callable[[float], bool], lo: float, hi: float) -> float:
    """The highest b in [lo, hi] where ``holds`` (true below it): inf if it holds at ``hi``, 0 if at no point of
    a scan down from ``hi`` (4 points a decade); else bisection on log b between the first point that holds and
    the one above it, to 1e-12 relative."""
    if holds(hi):
        return math.inf
    steps = math.ceil(4 * math.log10(hi / lo))
    above = hi
    for k in range(1, steps + 1):
        b = hi * (lo / hi) ** (k / steps)
        if holds(b):
            below = b
            break
        above = b
    else:
        return 0.0
    while above / below > 1 + 1e-12:
        mid = math.sqrt(below * above)
        below, above = (mid, above) if holds(mid) else (below, mid)
    return below


def crossover(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, H: int, *, factor: float = PAYS,
              compression: str | None = None, outer: float = 0.0, bandwidths: tuple = BANDWIDTHS) -> float:
    """The highest link bandwidth (bytes/s) below which DiLoCo with ``H`` is at least ``factor`` times faster
    than DDP: t_ddp(b) = factor · t_diloco(b) (the module's docstring gives the closed form); inf where it is
    so at every bandwidth searched, 0 where at none."""
    def holds(b: float) -> bool:
        f = with_bandwidth(fabric, b)
        return ddp_row(m, f, c, batch).step_s >= factor * diloco_row(m, f, c, batch, H, compression, outer).step_s

    return _highest(holds, *bandwidths)


def ddp_balance(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, bandwidths: tuple = BANDWIDTHS) -> float:
    """The link bandwidth (bytes/s) at which DDP's communication (all its all-reduces) equals its compute."""
    def holds(b: float) -> bool:
        p = plan_ddp(m, with_bandwidth(fabric, b), c, batch, "ring")
        return p.comm_s >= p.compute_s

    return _highest(holds, *bandwidths)


def measure_outer(name: str, reps: int = 3) -> float:
    """Median seconds per parameter of the outer step (:meth:`~distrain.parallel.diloco.OuterStep.sync`
    without its all-reduce: Δ, Nesterov SGD, the copy back) on the preset, on this process."""
    import torch

    from distrain.models import build_model
    from distrain.parallel.diloco import OuterStep

    torch.manual_seed(0)
    model = build_model(name)
    step = OuterStep(model.parameters(), group=None, islands=2)
    ts = []
    for _ in range(reps + 1):
        with torch.no_grad():
            for p in step.params:
                p.add_(1e-3)
        t0 = time.perf_counter()
        step.sync()
        ts.append(time.perf_counter() - t0)
    return sorted(ts[1:])[len(ts[1:]) // 2] / sum(p.numel() for p in step.params)


def mbit(bandwidth: float) -> str:
    """Bytes/s as payload Mbit/s for the report."""
    return f"{bandwidth * 8 / 1e6:,.1f} Mbit/s"


def _pays(what: str, b: float) -> str:
    if math.isinf(b):
        return f"{what} pays at every bandwidth up to {mbit(BANDWIDTHS[1])} per node"
    if not b:
        return f"{what} pays at no bandwidth down to {mbit(BANDWIDTHS[0])}"
    return f"{what} pays below {mbit(b)} per node"


def report(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, Hs: list[int], outer: float = 0.0) -> str:
    """``distrain plan --inner-steps H ...``: DDP's and DiLoCo's rows (float32, bf16, int8 and int4 outer
    gradients) and,
    for each, where DiLoCo pays (:data:`PAYS`) and where DDP's communication equals its compute."""
    K, M = _islands(fabric)
    rows = [ddp_row(m, fabric, c, batch)]
    for H in Hs:
        rows += [diloco_row(m, fabric, c, batch, H, comp, outer) for comp in COMPRESSIONS]
    lines = [f"# DiLoCo: {K} islands (one per node, {M} rank(s) each), the outer all-reduce every H steps (ring); "
             f"DDP: ring over all {fabric.size} ranks",
             f"{'strategy':<24} {'step ms':>9} {'compute':>9} {'comm':>9} {'bytes/node/step':>16}"]
    lines += [f"{r.strategy:<24} {r.step_s * 1e3:>9.2f} {r.compute_s * 1e3:>9.2f} {r.comm_s * 1e3:>9.2f} "
              f"{r.node_bytes:>16,.0f}" for r in rows]
    b = ddp_balance(m, fabric, c, batch)
    balance = (f"DDP's communication equals its compute at {mbit(b)}" if b and not math.isinf(b) else
               f"DDP's communication {'exceeds' if b else 'stays under'} its compute at every bandwidth searched")
    for H in Hs:
        for comp in COMPRESSIONS:
            what = f"DiLoCo H={H}" + (f" {comp}" if comp else "")
            b = crossover(m, fabric, c, batch, H, compression=comp, outer=outer)
            lines.append(f"# {_pays(what, b)} for this model ({balance})")
    lines.append(f"# pays: a step at least {PAYS:g}x faster than DDP's; Mbit/s of payload per node link and "
                 f"direction, the link's latency and the rest of the fabric as given")
    return "\n".join(lines)
