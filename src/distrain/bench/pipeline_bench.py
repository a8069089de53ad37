"""``distrain bench pipeline``: the measured pipeline bubble against (p - 1) / (m + p - 1).

Each of p stages is one :class:`SyntheticLayer` of fixed forward and backward cost, so the
schedule alone decides the idle time; p local ranks run GPipe and 1F1B for every m and report
the median bubble of :class:`~distrain.parallel.pipeline_parallel.PipelineTimeline` next to the
formula (and interleaved 1F1B with v chunks per rank next to (p - 1) / (v * m), Narayanan et al. 2021), the makespan next to the ideal (m + p - 1)(f + b), and each stage's peak of held
micro-batches and saved bytes. A library module only measures; this one owns the argparse.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain.bench.common import parse_choices, parse_ints
from distrain.errors import ConfigError
from distrain.launch import spawn
from distrain.parallel.pipeline_parallel import (
    InterleavedStage, PipelineStage, collect_timeline, interleaved_step, pipeline_step,
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
    """Identity whose forward takes f seconds and backward b seconds (busy loop or sleep)."""

    @staticmethod
    def forward(ctx, x, f_s, b_s, workload):
        _burn(f_s, workload)
        ctx.b_s, ctx.workload = b_s, workload
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _burn(ctx.b_s, ctx.workload)
        return g, None, None, None


class SyntheticLayer(nn.Module):
    """Linear(width, width) then a fixed cost: forward f_ms, backward b_ms. Equal on every stage,
    so the schedule, not the stage times, decides the bubble."""

    def __init__(self, width: int = 256, f_ms: float = 10.0, b_ms: float = 20.0, workload: str = "spin"):
        super().__init__()
        if workload not in ("spin", "sleep"):
            raise ConfigError(f"SyntheticLayer: workload must be 'spin' or 'sleep', got {workload!r}")
        self.lin = nn.Linear(width, width)
        self.f_s, self.b_s, self.workload = f_ms / 1e3, b_ms / 1e3, workload

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (rows, width) -> (rows, width)
        return _FixedCost.apply(self.lin(x), self.f_s, self.b_s, self.workload)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _timed(step, group, repeats: int):
    """One warm-up run of ``step()`` (connections, allocations), then ``repeats`` timed ones:
    (idle fractions, makespans, bubble/ideal ratios, the last PipelineTimeline)."""
    bubbles, spans, ratios, tl = [], [], [], None
    for r in range(repeats + 1):
        dist.barrier(group=group)
        tl = collect_timeline(step(), group=group)
        if r:
            bubbles.append(tl.bubble_fraction())
            spans.append(tl.makespan())
            ratios.append((tl.num_stages * tl.makespan() - tl.compute_time()) / tl.compute_time())
    return bubbles, spans, ratios, tl


def _row(p, m, v, schedule, timed, f_ms, b_ms, workload) -> dict:
    bubbles, spans, ratios, tl = timed
    return {"p": p, "m": m, "v": v, "schedule": schedule, "bubble": statistics.median(bubbles),
            "bubble_min": min(bubbles), "expected": (p - 1) / (v * m + p - 1),
            "over_ideal": statistics.median(ratios), "expected_over_ideal": (p - 1) / (v * m),
            "makespan_ms": statistics.median(spans) * 1e3, "ideal_makespan_ms": (m + (p - 1) / v) * (f_ms + b_ms),
            "peak_held": tl.peak_held(), "peak_saved_bytes": tl.peak_saved_bytes(), "workload": workload}


def _bubble_worker(rank: int, m_list, schedules, f_ms, b_ms, width, mb_rows, repeats, workload, virtual):
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

    rows = [_row(p, m, 1, s, _timed(lambda: plain(s, m), topo.pp_group, repeats), f_ms, b_ms, workload)
            for s in schedules for m in m_list]
    if virtual > 1:  # the same model cut into p*v chunks of 1/v the cost each
        chunks = [SyntheticLayer(width, f_ms / virtual, b_ms / virtual, workload) for _ in range(p * virtual)]
        inter = InterleavedStage.from_topology(chunks, topo, virtual, balance=[1] * (p * virtual))

        def interleaved(m):
            x, y = batch(m)
            inter.zero_grad()
            interleaved_step(inter, x, y, _mse if last else None, num_microbatches=m)
            return inter.timeline

        rows += [_row(p, m, virtual, f"interleaved 1F1B v={virtual}", _timed(lambda: interleaved(m), topo.pp_group,
                                                                             repeats), f_ms, b_ms, workload)
                 for m in m_list if m % p == 0]
    return rows if rank == 0 else None


def measure_bubbles(pp_list=(2, 4), m_list=(1, 2, 4, 8), schedules=("gpipe", "1f1b"), *, f_ms: float = 10.0,
                    b_ms: float = 20.0, width: int = 256, mb_rows: int = 16, repeats: int = 3,
                    workload: str = "spin", timeout: float = 600.0, virtual: int = 0) -> list[dict]:
    """Measured bubble fraction per (p, m, schedule) next to (p - 1) / (m + p - 1), and the
    bubble over the ideal compute time next to (p - 1) / (v * m) (v = 1 but for interleaved 1F1B).
    ``virtual`` > 1 adds interleaved 1F1B with that many chunks per rank, for every m that p divides.

    Each of p stages is one :class:`SyntheticLayer` (forward ``f_ms``, backward ``b_ms``;
    micro-batches of ``mb_rows`` x ``width`` floats), run on p local ranks (one spawn per p).
    Per configuration: one warm-up step, then ``repeats`` steps; the row holds the median and
    the smallest bubble, the median makespan against the ideal (m + p - 1)(f + b), and each
    stage's peak held micro-batches and peak bytes of saved stage inputs + outputs.
    """
    rows: list[dict] = []
    for p in pp_list:
        out = spawn(_bubble_worker, p, args=(tuple(m_list), tuple(schedules), f_ms, b_ms, width, mb_rows, repeats,
                                              workload, virtual), timeout=timeout, threads_per_rank=1)
        rows += out[0]
    return rows


def format_bubble_table(rows: list[dict]) -> str:
    """A markdown table of :func:`measure_bubbles` rows."""
    lines = ["| p | m | schedule | bubble (median) | bubble (min) | (p-1)/(v·m+p-1) | bubble / ideal | (p-1)/(v·m) "
             "| makespan ms | ideal ms | peak held per stage | peak saved KiB per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kib = ", ".join(f"{b / 1024:.0f}" for b in r["peak_saved_bytes"])
        lines.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {r['bubble']:.3f} | {r['bubble_min']:.3f} | "
                     f"{r['expected']:.3f} | {r['over_ideal']:.3f} | {r['expected_over_ideal']:.3f} | "
                     f"{r['makespan_ms']:.0f} | {r['ideal_makespan_ms']:.0f} | "
                     f"{', '.join(map(str, r['peak_held']))} | {kib} |")
    return "\n".join(lines)


def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", default="2,4", help="pipeline sizes")
    p.add_argument("--microbatches", "--m", dest="m", default="1,2,4,8", help="micro-batch counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--workload", default="spin", help="spin (busy CPU) or sleep (idle CPU) stage cost")
    p.add_argument("--virtual", type=int, default=0,
                   help="also run interleaved 1F1B with this many chunks per rank (0 or 1: not)")
    p.add_argument("--json", default=None)


def run_pipeline(args: argparse.Namespace) -> int:
    workload = parse_choices(args.workload, ("spin", "sleep"), "--workload")[0]
    if args.virtual < 0:
        raise ConfigError(f"--virtual must be >= 0, got {args.virtual}")
    rows = measure_bubbles(parse_ints(args.pp, "--pp", 2), parse_ints(args.m, "--m"), repeats=args.repeats,
                           workload=workload, virtual=args.virtual)
    print(format_bubble_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
