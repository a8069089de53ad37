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

* **Streaming DiLoCo** (``--fragments P --overlap-steps τ``, :mod:`distrain.parallel.diloco.streaming`):
  the parameters in training's P fragments (:func:`fragment_sizes`), fragment p's outer all-reduce (of its
  n_p elements, t_p seconds) after every step s with (s + 1 − p·H//P) mod H = 0, running while the next τ
  inner steps go on and waited for after the τ-th (τ = 0: blocking). Where no exchange waits for another
  (each one done before the next is sent) only its part beyond the τ steps is paid::

      t_streaming(H, P, τ) = t_inner + Σ_p (max(0, t_p − τ · t_inner) + outer · n_p) / H

  :func:`streaming_step` plays the schedule (exchanges one after another on the link, as the comm thread
  sends them), so where they queue (t_p longer than the steps between two sends) the step is what the
  link allows, down to Σ_p t_p / H. The bytes per H steps are DiLoCo's; the **peak step bytes**, the most
  a node sends in one step, fall from the whole model's all-reduce to the largest fragment's (those of the
  fragments sent in the same step, where P > H). int8/int4 are blocking (two exchanges): τ = 0 only, as in
  training.

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
from distrain.parallel.diloco.streaming import fragment_cuts, offsets

PAYS = 2.0  # "DiLoCo pays": its step at least this many times faster than DDP's (its replicas drift for H steps,
# so an equal step time would gain nothing); crossover() takes any factor
BANDWIDTHS = (125.0, 1.25e12)  # bytes/s searched: 1 kbit/s to 10 Tbit/s of payload per node link
ELEM = {None: 4, "bf16": 2}  # bytes per element of the outer all-reduce (float32 parameters)
COMPRESSIONS = (None, "bf16", "int8", "int4")  # --outer-compression: int8/int4 are quantized (not a ring's sum)


@dataclass(frozen=True)
class Row:
    """One strategy's predicted step: seconds (``comm_s``: all communication per step, amortized for DiLoCo's
    outer all-reduce, hidden or not; ``compute_s``: forward+backward, the optimizer and the amortized outer
    step), the busiest node's bytes sent over its link per step (``node_bytes``, averaged over H steps) and in
    its busiest step (``peak_bytes``: DDP's every step, DiLoCo's sync step, Streaming DiLoCo's largest
    fragment's)."""
    strategy: str
    step_s: float
    compute_s: float
    comm_s: float
    node_bytes: float
    peak_bytes: float


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
    node = float(max(per_node.values(), default=0))
    return Row("ddp ring", p.step_s, p.compute_s, p.comm_s, node, node)


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
    seconds, per_node = _exchange(m.params, fabric, compression)
    return seconds, float(max(per_node))


def _exchange(n: int, fabric: Fabric, compression: str | None) -> tuple[float, list[int]]:
    """(seconds, bytes sent by each node) of the outer all-reduce of ``n`` elements (all of Δ or a fragment's)."""
    K, M = _islands(fabric)
    groups = [[i * M + j for i in range(K)] for j in range(M)]
    if compression in quantized.BITS:
        # an all-to-all of the chunks and an all-gather of the mean's (parallel/diloco/quantized.py): each rank
        # sends about what a ring all-reduce of those payloads would, so its time is the ring's on them
        sent = quantized.sync_bytes(n, K, quantized.BITS[compression])
        seconds, _ = ring_time(fabric, groups, round(sent * K / (2 * (K - 1))), "all_reduce", 1)
        return seconds, [M * sent] * K
    elem = ELEM[compression]
    seconds, _ = ring_time(fabric, groups, n * elem, "all_reduce", elem)
    return seconds, [M * _ring_bytes(K, n, elem, i) for i in range(K)]  # node i: place i of M cross groups


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
               inner.comm_s + sync_s / H, sync_bytes / H, sync_bytes)


def fragment_sizes(m: ModelSpec, P: int) -> list[int]:
    """Elements of each of Streaming DiLoCo's ``P`` fragments: training's cut
    (:func:`~distrain.parallel.diloco.streaming.fragment_cuts`) of a preset's parameter tensors; with
    ``--params`` (no tensors known) N split as evenly as whole elements allow."""
    if m.param_bytes:
        sizes = [b // 4 for b in m.param_bytes]
        return [sum(sizes[a:b]) for a, b in fragment_cuts(sizes, P)]
    if not 1 <= P <= m.params:
        raise ConfigError(f"--fragments must be in 1..{m.params} (the parameters), got {P}")
    return [m.params // P + (p < m.params % P) for p in range(P)]


def streaming_step(t_inner: float, t_frag: list[float], t_outer: list[float], H: int, tau: int) -> float:
    """Seconds per step of Streaming DiLoCo's schedule in its steady state: each step ``t_inner``; after step s
    (the exchanges due then applied first, as :meth:`StreamingOuter.step` does) fragment p's exchange
    (``t_frag[p]`` seconds, FIFO behind any still on the link) is sent where (s + 1 − p·H//P) mod H = 0 and
    waited for after step s + ``tau`` (at once with τ = 0), then its outer step (``t_outer[p]``). Played for
    8 periods of H steps; the last two give the step."""
    due: dict[int, list[int]] = {}
    for p, o in enumerate(offsets(len(t_frag), H)):
        due.setdefault((o - 1) % H, []).append(p)  # (s + 1 - o) % H == 0  <=>  s % H == (o - 1) % H
    now = free = 0.0
    pending: dict[int, list[tuple[float, float]]] = {}  # step after which to wait -> [(exchange end, outer s)]
    marks = []
    for s in range(8 * H):
        now += t_inner
        for end, out in pending.pop(s, ()):
            now = max(now, end) + out
        for p in due.get(s % H, ()):
            free = max(now, free) + t_frag[p]
            if tau:
                pending.setdefault(s + tau, []).append((free, t_outer[p]))
            else:
                now = free + t_outer[p]
        if (s + 1) % H == 0:
            marks.append(now)
    return (marks[-1] - marks[-3]) / (2 * H)


def streaming_row(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, H: int, P: int, tau: int,
                  compression: str | None = None, outer: float = 0.0) -> Row:
    """Streaming DiLoCo (``--fragments P --overlap-steps tau``) with ``H`` inner steps, one island per node of
    ``fabric``: the step from :func:`streaming_step`, the bytes of every fragment's exchange."""
    if H < 1:
        raise ConfigError(f"--inner-steps {H}: give H >= 1 inner steps between outer steps")
    if not 0 <= tau < H:
        raise ConfigError(f"--overlap-steps must be in 0..--inner-steps - 1 = {H - 1} (an exchange is applied "
                          f"before the fragment's next one starts), got {tau}")
    if tau and compression in quantized.BITS:
        raise ConfigError(f"--overlap-steps {tau} with --outer-compression {compression}: the quantized mean is "
                          f"two blocking exchanges; plan it with --overlap-steps 0")
    K, M = _islands(fabric)
    inner = plan_ddp(m, fabric.with_placement((0,) * M), c, batch / K, "ring")
    sizes = fragment_sizes(m, P)
    exchanges = [_exchange(n, fabric, compression) for n in sizes]
    step = streaming_step(inner.step_s, [t for t, _ in exchanges], [outer * n for n in sizes], H, tau)
    per_node = [sum(sent[i] for _, sent in exchanges) for i in range(K)]
    at_once: dict[int, list[int]] = {}  # fragments sent after the same step (P > H)
    for p, o in enumerate(offsets(P, H)):
        at_once.setdefault(o, []).append(p)
    peak = max(sum(exchanges[p][1][i] for p in ps) for ps in at_once.values() for i in range(K))
    name = f"streaming H={H} P={P} tau={tau}" + (f" {compression}" if compression else "")
    return Row(name, step, inner.compute_s + outer * m.params / H,
               inner.comm_s + sum(t for t, _ in exchanges) / H, max(per_node) / H, float(peak))


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
              compression: str | None = None, outer: float = 0.0, bandwidths: tuple = BANDWIDTHS,
              fragments: int = 1, overlap: int = 0) -> float:
    """The highest link bandwidth (bytes/s) below which DiLoCo with ``H`` (Streaming DiLoCo with ``fragments``
    P and ``overlap`` τ where either is given) is at least ``factor`` times faster than DDP: t_ddp(b) =
    factor · t_diloco(b) (the module's docstring gives the closed form); inf where it is so at every
    bandwidth searched, 0 where at none."""
    def row(f: Fabric) -> Row:
        if fragments > 1 or overlap:
            return streaming_row(m, f, c, batch, H, fragments, overlap, compression, outer)
        return diloco_row(m, f, c, batch, H, compression, outer)

    def holds(b: float) -> bool:
        f = with_bandwidth(fabric, b)
        return ddp_row(m, f, c, batch).step_s >= factor * row(f).step_s

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


def streaming_forms(tau: int) -> list[tuple[str | None, int]]:
    """(outer compression, τ) of Streaming DiLoCo's rows: every compression, int8/int4 blocking (τ = 0) as
    training requires."""
    return [(comp, 0 if comp in quantized.BITS else tau) for comp in COMPRESSIONS]


def report(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, Hs: list[int], outer: float = 0.0,
           fragments: int | None = None, overlap: int = 0) -> str:
    """``distrain plan --inner-steps H ... [--fragments P [--overlap-steps tau]]``: DDP's and DiLoCo's rows
    (float32, bf16, int8 and int4 outer gradients), Streaming DiLoCo's where ``fragments`` is given (int8/int4
    at τ = 0) and, for each, where it pays (:data:`PAYS`) and where DDP's communication equals its compute."""
    K, M = _islands(fabric)
    rows = [ddp_row(m, fabric, c, batch)]
    pays = []  # (the line's name, crossover keywords)
    for H in Hs:
        rows += [diloco_row(m, fabric, c, batch, H, comp, outer) for comp in COMPRESSIONS]
        pays += [(f"DiLoCo H={H}" + (f" {comp}" if comp else ""), dict(H=H, compression=comp))
                 for comp in COMPRESSIONS]
    if fragments is not None:
        for H in Hs:
            for comp, tau in streaming_forms(overlap):
                rows.append(streaming_row(m, fabric, c, batch, H, fragments, tau, comp, outer))
                pays.append((f"Streaming DiLoCo H={H} P={fragments} tau={tau}" + (f" {comp}" if comp else ""),
                             dict(H=H, compression=comp, fragments=fragments, overlap=tau)))
    w = max(24, *(len(r.strategy) for r in rows))
    lines = [f"# DiLoCo: {K} islands (one per node, {M} rank(s) each), the outer all-reduce every H steps (ring); "
             f"DDP: ring over all {fabric.size} ranks",
             f"{'strategy':<{w}} {'step ms':>9} {'compute':>9} {'comm':>9} {'bytes/node/step':>16} "
             f"{'peak step bytes':>16}"]
    lines += [f"{r.strategy:<{w}} {r.step_s * 1e3:>9.2f} {r.compute_s * 1e3:>9.2f} {r.comm_s * 1e3:>9.2f} "
              f"{r.node_bytes:>16,.0f} {r.peak_bytes:>16,.0f}" for r in rows]
    b = ddp_balance(m, fabric, c, batch)
    balance = (f"DDP's communication equals its compute at {mbit(b)}" if b and not math.isinf(b) else
               f"DDP's communication {'exceeds' if b else 'stays under'} its compute at every bandwidth searched")
    for what, kw in pays:
        H = kw.pop("H")
        b = crossover(m, fabric, c, batch, H, outer=outer, **kw)
        lines.append(f"# {_pays(what, b)} for this model ({balance})")
    lines.append(f"# pays: a step at least {PAYS:g}x faster than DDP's; Mbit/s of payload per node link and "
                 f"direction, the link's latency and the rest of the fabric as given; peak step bytes: the most "
                 f"a node sends in one step"
                 + ("; streaming's comm counts every exchange, its step only what the tau overlapped steps do not "
                    "hide" if fragments is not None else ""))
    return "\n".join(lines)
