"""``distrain bench pipeline``: the measured pipeline bubble against (p - 1) / (m + p - 1).

Each of p stages is one :class:`SyntheticLayer` of fixed forward and backward cost, so the
schedule alone decides the idle time; p local ranks run GPipe, 1F1B and zero-bubble ZB-H1
for every m and report the median bubble of
:class:`~distrain.parallel.pipeline_parallel.PipelineTimeline` next to the formula
((p - 1) / (m + p - 1); ZB-H1: (p - 1) / (3m + p - 1), Qi et al. 2024; interleaved 1F1B with
v chunks per rank: (p - 1) / (v * m) over the ideal compute, Narayanan et al. 2021), the
makespan next to the ideal one, and each stage's peak of held micro-batches and saved bytes.
The layer's backward cost b is half input gradient, half weight gradient (``w_ms``, deferred
to the W pass under ZB-H1), so with f = b / 2 every op costs the same: T_F = T_B = T_W, the
paper's assumption. The command line (distrain/cli/bench.py) parses the flags and calls :func:`run`.
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.launch import spawn
from distrain.parallel.pipeline_parallel import (
    InterleavedStage, PipelineStage, collect_timeline, deferral, ideal_bubble, interleaved_step,
    pipeline_step, simulate,
)
from distrain.topology import Topology


def _burn(seconds: float, workload: str) -> None:
    if workload == "sleep":
        time.sleep(seconds)
        return
    # "spin": a busy loop of fixed wall-clock duration (it holds a core, like real compute, and so
    # competes with the process's Gloo I/O thread; "sleep" leaves the core to it)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class _FixedCost(torch.autograd.Function):
    """Identity whose forward takes f seconds and backward b seconds (busy loop or sleep), of
    which w seconds stand for the weight gradient: deferred to the W pass when the forward ran
    under ``defer_weight_grads`` (zero-bubble schedules), else spent in the backward."""

    @staticmethod
    def forward(ctx, x, f_s, b_s, w_s, workload):
        _burn(f_s, workload)
        ctx.b_s, ctx.w_s, ctx.workload, ctx.deferral = b_s, w_s, workload, deferral()
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.deferral is None:
            _burn(ctx.b_s, ctx.workload)
        else:
            store, key = ctx.deferral
            _burn(ctx.b_s - ctx.w_s, ctx.workload)
            w_s, workload = ctx.w_s, ctx.workload
            store.defer(key, lambda: _burn(w_s, workload))
        return g, None, None, None, None


class SyntheticLayer(nn.Module):
    """Linear(width, width) then a fixed cost: forward f_ms, backward b_ms (w_ms of it the weight
    gradient; default b_ms / 2). Equal on every stage, so the schedule, not the stage times,
    decides the bubble."""

    def __init__(self, width: int = 256, f_ms: float = 10.0, b_ms: float = 20.0, workload: str = "spin",
                 w_ms: float | None = None):
        super().__init__()
        if workload not in ("spin", "sleep"):
            raise ConfigError(f"SyntheticLayer: workload must be 'spin' or 'sleep', got {workload!r}")
        w_ms = b_ms / 2 if w_ms is None else w_ms
        if not 0 <= w_ms <= b_ms:
            raise ConfigError(f"SyntheticLayer: w_ms={w_ms} must be within the backward's b_ms={b_ms}")
        self.lin = nn.Linear(width, width)
        self.f_s, self.b_s, self.w_s, self.workload = f_ms / 1e3, b_ms / 1e3, w_ms / 1e3, workload

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        return _FixedCost.apply(self.lin(x), self.f_s, self.b_s, self.w_s, self.workload)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _interleaved_rounds(configs, group, repeats: int) -> list[list]:
    """Round 0 runs every configuration's ``step()`` once untimed (connections, allocations); then
    ``repeats`` rounds each run every configuration once, in turn, so that a change of machine
    load hits all schedules alike. Returns each configuration's timed PipelineTimelines."""
    timed: list[list] = [[] for _ in configs]
    for r in range(repeats + 1):
        for i, step in enumerate(configs):
            dist.barrier(group=group)
            tl = collect_timeline(step(), group=group)
            if r:
                timed[i].append(tl)
    return timed


def _row(p, m, v, schedule, tls, f_ms, b_ms, workload) -> dict:
    bubbles = [tl.bubble_fraction() for tl in tls]
    spans = [tl.makespan() for tl in tls]
    ratios = [(tl.num_stages * tl.makespan() - tl.compute_time()) / tl.compute_time() for tl in tls]
    expected, over = (p - 1) / (v * m + p - 1), (p - 1) / (v * m)
    ideal_ms = (m + (p - 1) / v) * (f_ms + b_ms)
    if schedule == "zb-h1":  # the formula assumes T_F = T_B = T_W (f = b / 2); ideal_ms is exact for any f, b
        expected = ideal_bubble(p, m, schedule)
        ideal_ms = simulate(schedule, p, m, f_cost=f_ms, b_cost=b_ms).makespan()
        over = (ideal_ms - m * (f_ms + b_ms)) / (m * (f_ms + b_ms))
    return {"p": p, "m": m, "v": v, "schedule": schedule, "bubble": statistics.median(bubbles),
            "bubble_min": min(bubbles), "expected": expected,
            "over_ideal": statistics.median(ratios), "expected_over_ideal": over,
            "makespan_ms": statistics.median(spans) * 1e3, "ideal_makespan_ms": ideal_ms,
            "peak_held": tls[-1].peak_held(), "peak_saved_bytes": tls[-1].peak_saved_bytes(), "workload": workload}


def _bubble_worker(rank: int, m_list, schedules, f_ms, b_ms, width, mb_rows, repeats, workload, virtual, gantt):
    p = dist.get_world_size()
    topo = Topology.from_world(pp=p)
    torch.manual_seed(0)
    layers = [SyntheticLayer(width, f_ms, b_ms, workload) for _ in range(p)]
    stage = PipelineStage.from_topology(layers, topo, balance=[1] * p, name="the synthetic model")
    first, last = topo.pp_rank == 0, topo.pp_rank == p - 1

    def batch(m):
        return (torch.randn(m * mb_rows, width) if first else None,  # (m * rows, width)
                torch.zeros(m * mb_rows, width) if last else None)

    def plain(schedule, m):
        x, y = batch(m)
        stage.zero_grad()
        pipeline_step(stage, x, y, _mse if last else None, schedule=schedule, num_microbatches=m)
        return stage.timeline

    # (schedule label, m, v, step) per configuration
    configs = [(s, m, 1, lambda s=s, m=m: plain(s, m)) for s in schedules for m in m_list]
    if virtual > 1:  # the same model cut into p*v chunks of 1/v the cost each
        chunks = [SyntheticLayer(width, f_ms / virtual, b_ms / virtual, workload) for _ in range(p * virtual)]
        inter = InterleavedStage.from_topology(chunks, topo, virtual, balance=[1] * (p * virtual))

        def interleaved(m):
            x, y = batch(m)
            inter.zero_grad()
            interleaved_step(inter, x, y, _mse if last else None, num_microbatches=m)
            return inter.timeline

        configs += [(f"interleaved 1F1B v={virtual}", m, virtual, lambda m=m: interleaved(m))
                    for m in m_list if m % p == 0]
    timed = _interleaved_rounds([c[3] for c in configs], topo.pp_group, repeats)
    rows = [_row(p, m, v, label, tls, f_ms, b_ms, workload) for (label, m, v, _), tls in zip(configs, timed)]
    if gantt and rank == 0:  # the last timed step of each configuration
        for (label, m, v, _), tls, row in zip(configs, timed, rows):
            name = f"{label.split()[0]}{f'_v{v}' if v > 1 else ''}_p{p}_m{m}.png"
            tls[-1].plot_gantt(os.path.join(gantt, name), title=f"{label}, p={p}, m={m}: bubble "
                               f"{tls[-1].bubble_fraction():.3f}, formula {row['expected']:.3f} (last step)")
    return rows if rank == 0 else None


def measure_bubbles(pp_list=(2, 4), m_list=(1, 2, 4, 8), schedules=("gpipe", "1f1b"), *, f_ms: float = 10.0,
                    b_ms: float = 20.0, width: int = 256, mb_rows: int = 16, repeats: int = 3,
                    workload: str = "spin", timeout: float = 600.0, virtual: int = 0,
                    gantt: str | None = None) -> list[dict]:
    """Measured bubble fraction per (p, m, schedule) next to (p - 1) / (m + p - 1) (ZB-H1:
    :func:`~distrain.parallel.pipeline_parallel.zb_h1_bubble`), and the bubble over the ideal
    compute time next to (p - 1) / (v * m) (v = 1 but for interleaved 1F1B).
    ``virtual`` > 1 adds interleaved 1F1B with that many chunks per rank, for every m that p divides.

    Each of p stages is one :class:`SyntheticLayer` (forward ``f_ms``, backward ``b_ms``;
    micro-batches of ``mb_rows`` x ``width`` floats), run on p local ranks (one spawn per p).
    One warm-up step per configuration, then ``repeats`` rounds that each run every configuration
    once (interleaved, so load changes hit all alike); the row holds the median and
    the smallest bubble, the median makespan against the ideal ((m + p - 1)(f + b); ZB-H1: its
    simulated order with F = f, B = W = b / 2), and each
    stage's peak held micro-batches and peak bytes of saved stage inputs + outputs (ZB-H1: and
    the layer inputs and output gradients kept for W). ``gantt``: a folder where rank 0 draws
    each configuration's last step as ``<schedule>[_v<v>]_p<p>_m<m>.png``.
    """
    rows: list[dict] = []
    if gantt:
        os.makedirs(gantt, exist_ok=True)
    for p in pp_list:
        out = spawn(_bubble_worker, p, args=(tuple(m_list), tuple(schedules), f_ms, b_ms, width, mb_rows, repeats,
                                              workload, virtual, gantt), timeout=timeout, threads_per_rank=1)
        rows += out[0]
    return rows


def format_bubble_table(rows: list[dict]) -> str:
    """A markdown table of :func:`measure_bubbles` rows."""
    lines = ["| p | m | schedule | bubble (median) | bubble (min) | formula | bubble / ideal | formula / ideal "
             "| makespan ms | ideal ms | peak held per stage | peak saved KiB per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kib = ", ".join(f"{b / 1024:.0f}" for b in r["peak_saved_bytes"])
        lines.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {r['bubble']:.3f} | {r['bubble_min']:.3f} | "
                     f"{r['expected']:.3f} | {r['over_ideal']:.3f} | {r['expected_over_ideal']:.3f} | "
                     f"{r['makespan_ms']:.0f} | {r['ideal_makespan_ms']:.0f} | "
                     f"{', '.join(map(str, r['peak_held']))} | {kib} |")
    return "\n".join(lines)


def run(pp: list[int], m: list[int], schedules: list[str], repeats: int, workload: str, virtual: int,
        gantt: str | None = None, json_path: str | None = None) -> int:
    """``distrain bench pipeline``: :func:`measure_bubbles`, its table printed, its rows written to ``json_path``."""
    if virtual < 0:
        raise ConfigError(f"--virtual must be >= 0, got {virtual}")
    rows = measure_bubbles(pp, m, schedules, repeats=repeats, workload=workload, virtual=virtual, gantt=gantt)
    print(format_bubble_table(rows))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
