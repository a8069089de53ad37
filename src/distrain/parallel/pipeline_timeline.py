"""Per-stage timelines of a pipeline step: what ran when, the bubble, memory peaks, traces.

Each rank records a :class:`StageTimeline` during ``pipeline_step`` (``stage.timeline``):
its compute ops ``(kind "F"/"B", micro-batch, start, end)`` in ``time.perf_counter`` seconds,
the time it spent blocked in receives, and the peaks of what it held for backward.
:func:`collect_timeline` gathers the stages' timelines (``all_gather_object`` or
``gather_object`` on the pipeline's group) into a :class:`PipelineTimeline`, which computes
the bubble fraction and writes a Chrome trace and a Gantt chart.

:func:`measure_bubbles` (``python -m distrain.parallel.pipeline``) runs equal synthetic stages and
reports the measured bubble per (p, m, schedule) next to (p - 1) / (m + p - 1).

Clocks: ``perf_counter`` is CLOCK_MONOTONIC on Linux, shared by all processes of one
machine, so stages on one host are on one time axis. Stages on different machines are not;
their trace still shows each stage's own order, but the measured bubble is meaningless there.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from distrain.errors import ConfigError


@dataclass
class StageTimeline:
    """One stage's record of one pipeline step (picklable: it travels by ``gather_object``)."""

    stage: int
    rank: int
    num_stages: int
    schedule: str
    num_microbatches: int
    events: list[tuple[str, int, float, float]] = field(default_factory=list)  # (kind, mb, start, end)
    waits: list[tuple[str, int, float, float]] = field(default_factory=list)  # ("recv_act"|"recv_grad", mb, ...)
    peak_held: int = 0  # most micro-batches whose activations were held at once
    peak_saved_bytes: int = 0  # most bytes of stage inputs + outputs kept for backward at once

    def add(self, kind: str, mb: int, start: float, end: float) -> None:
        self.events.append((kind, mb, start, end))

    def add_wait(self, kind: str, mb: int, start: float, end: float) -> None:
        self.waits.append((kind, mb, start, end))

    def note_held(self, held: int, saved_bytes: int) -> None:
        self.peak_held = max(self.peak_held, held)
        self.peak_saved_bytes = max(self.peak_saved_bytes, saved_bytes)

    def order(self) -> list[tuple[str, int]]:
        """The compute ops as run: [("F", 0), ("F", 1), ("B", 1), ...]."""
        return [(k, mb) for k, mb, _, _ in self.events]

    def compute_time(self) -> float:
        return sum(e - s for _, _, s, e in self.events)

    def wait_time(self) -> float:
        return sum(e - s for _, _, s, e in self.waits)


class PipelineTimeline:
    """All stages' timelines of one step, ordered by stage."""

    def __init__(self, stages: list[StageTimeline]):
        if not stages:
            raise ConfigError("PipelineTimeline needs at least one stage timeline")
        self.stages = sorted(stages, key=lambda t: t.stage)
        got = [t.stage for t in self.stages]
        p = self.stages[0].num_stages
        if got != list(range(p)):
            raise ConfigError(f"PipelineTimeline: expected one timeline for each of the stages 0..{p - 1}, "
                              f"got stages {got} (gather over the pipeline's group, e.g. topo.pp_group)")
        self.num_stages = p
        self.schedule = self.stages[0].schedule
        self.num_microbatches = self.stages[0].num_microbatches

    # -- measures ----------------------------------------------------------------------
    @property
    def t0(self) -> float:
        return min(s for t in self.stages for _, _, s, _ in t.events)

    @property
    def t1(self) -> float:
        return max(e for t in self.stages for _, _, _, e in t.events)

    def makespan(self) -> float:
        """From the first forward's start to the last backward's end, over all stages (seconds)."""
        return self.t1 - self.t0

    def compute_time(self) -> float:
        return sum(t.compute_time() for t in self.stages)

    def bubble_fraction(self) -> float:
        """1 - (compute time summed over stages) / (num_stages * makespan)."""
        span = self.makespan()
        return 0.0 if span <= 0 else 1.0 - self.compute_time() / (self.num_stages * span)

    def expected_bubble(self) -> float:
        """(p - 1) / (m + p - 1), the bubble of equal stages with free communication."""
        p, m = self.num_stages, self.num_microbatches
        return (p - 1) / (m + p - 1)

    def orders(self) -> list[list[tuple[str, int]]]:
        return [t.order() for t in self.stages]

    def peak_held(self) -> list[int]:
        return [t.peak_held for t in self.stages]

    def peak_saved_bytes(self) -> list[int]:
        return [t.peak_saved_bytes for t in self.stages]

    def summary(self) -> dict:
        return {
            "schedule": self.schedule, "num_stages": self.num_stages, "num_microbatches": self.num_microbatches,
            "makespan_s": self.makespan(), "bubble": self.bubble_fraction(), "expected_bubble": self.expected_bubble(),
            "compute_s": [t.compute_time() for t in self.stages], "wait_s": [t.wait_time() for t in self.stages],
            "peak_held": self.peak_held(), "peak_saved_bytes": self.peak_saved_bytes(),
        }

    # -- outputs -----------------------------------------------------------------------
    def to_chrome_trace(self, path=None) -> dict:
        """Chrome trace JSON (chrome://tracing, ui.perfetto.dev): one process per stage,
        thread 0 its compute ops ("X" events F<k>/B<k>), thread 1 its receive waits.
        Times are microseconds from the step's first forward. Writes ``path`` if given."""
        t0 = self.t0
        ev: list[dict] = []
        for t in self.stages:
            ev.append({"name": "process_name", "ph": "M", "pid": t.stage, "tid": 0,
                       "args": {"name": f"stage {t.stage} (rank {t.rank})"}})
            ev.append({"name": "process_sort_index", "ph": "M", "pid": t.stage, "tid": 0,
                       "args": {"sort_index": t.stage}})
            ev.append({"name": "thread_name", "ph": "M", "pid": t.stage, "tid": 0, "args": {"name": "compute"}})
            ev.append({"name": "thread_name", "ph": "M", "pid": t.stage, "tid": 1, "args": {"name": "recv wait"}})
            for kind, mb, s, e in t.events:
                ev.append({"name": f"{kind}{mb}", "cat": kind, "ph": "X", "pid": t.stage, "tid": 0,
                           "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6, "args": {"microbatch": mb}})
            for kind, mb, s, e in t.waits:
                ev.append({"name": f"{kind} {mb}", "cat": "wait", "ph": "X", "pid": t.stage, "tid": 1,
                           "ts": (s - t0) * 1e6, "dur": (e - s) * 1e6, "args": {"microbatch": mb}})
        trace = {"traceEvents": ev, "displayTimeUnit": "ms",
                 "otherData": {k: v for k, v in self.summary().items() if not isinstance(v, list)}}
        if path is not None:
            with open(path, "w") as f:
                json.dump(trace, f)
        return trace

    def plot_gantt(self, path, title: str | None = None) -> None:
        """Draw a PNG Gantt chart: one row per stage, forwards blue, backwards green, waits hatched."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0, p = self.t0, self.num_stages
        span_ms = max(self.makespan() * 1e3, 1e-9)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.45 * 2 * self.num_microbatches), 0.6 * p + 1.4))
        colors = {"F": "#4c72b0", "B": "#55a868"}
        for t in self.stages:
            y = p - 1 - t.stage
            for kind, mb, s, e in t.waits:
                ax.broken_barh([((s - t0) * 1e3, (e - s) * 1e3)], (y - 0.2, 0.4), facecolors="none",
                               edgecolors="#bbbbbb", hatch="///", linewidth=0.3)
            for kind, mb, s, e in t.events:
                x, w = (s - t0) * 1e3, (e - s) * 1e3
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colors.get(kind, "#999999"),
                               edgecolors="black", linewidth=0.5)
                if w > span_ms / 80:
                    ax.text(x + w / 2, y, f"{kind}{mb}", ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"stage {p - 1 - i}" for i in range(p)])
        ax.set_xlabel("time since the first forward (ms)")
        ax.set_xlim(0, span_ms)
        ax.set_title(title or (f"{self.schedule}, p={p}, m={self.num_microbatches}: bubble "
                               f"{self.bubble_fraction():.3f} (ideal (p-1)/(m+p-1) = {self.expected_bubble():.3f})"),
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def collect_timeline(timeline: StageTimeline, group=None, dst: int | None = None) -> PipelineTimeline | None:
    """Gather every stage's timeline of one pipeline (collective over ``group``, its pp group).

    ``dst=None``: ``all_gather_object``, every rank gets the :class:`PipelineTimeline`.
    ``dst=<global rank>``: ``gather_object`` to that rank, the others get None.
    ``group`` must hold exactly the ranks of one pipeline (``topo.pp_group``; None = the world
    when the world is one pipeline).
    """
    import torch.distributed as dist

    n = dist.get_world_size(group)
    if dst is None:
        out: list = [None] * n
        dist.all_gather_object(out, timeline, group=group)
        return PipelineTimeline(out)
    out = [None] * n if dist.get_rank() == dst else None
    dist.gather_object(timeline, out, dst=dst, group=group)
    return PipelineTimeline(out) if out is not None else None


# ---------------------------------------------------------------------------------------
# Benchmark: measured bubble of equal synthetic stages against (p - 1) / (m + p - 1)
# ---------------------------------------------------------------------------------------

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


def _bubble_worker(rank: int, m_list, schedules, f_ms, b_ms, width, mb_rows, repeats, workload):
    import statistics

    import torch.distributed as dist

    from distrain.parallel.pipeline import PipelineStage, pipeline_step
    from distrain.topology import Topology

    p = dist.get_world_size()
    topo = Topology.from_world(pp=p)
    torch.manual_seed(0)
    layers = [SyntheticLayer(width, f_ms, b_ms, workload) for _ in range(p)]
    stage = PipelineStage.from_topology(layers, topo, balance=[1] * p, name="the synthetic model")
    rows = []
    for schedule in schedules:
        for m in m_list:
            bubbles, spans, tl = [], [], None
            for r in range(repeats + 1):  # run 0 warms up (connections, allocations)
                x = torch.randn(m * mb_rows, width) if stage.is_first else None  # (m * rows, width)
                y = torch.zeros(m * mb_rows, width) if stage.is_last else None
                stage.zero_grad()
                dist.barrier(group=topo.pp_group)
                pipeline_step(stage, x, y, _mse if stage.is_last else None, schedule=schedule, num_microbatches=m)
                tl = collect_timeline(stage.timeline, group=topo.pp_group)
                if r:
                    bubbles.append(tl.bubble_fraction())
                    spans.append(tl.makespan())
            rows.append({
                "p": p, "m": m, "schedule": schedule, "bubble": statistics.median(bubbles), "bubble_min": min(bubbles),
                "expected": tl.expected_bubble(), "makespan_ms": statistics.median(spans) * 1e3,
                "ideal_makespan_ms": (m + p - 1) * (f_ms + b_ms), "peak_held": tl.peak_held(),
                "peak_saved_bytes": tl.peak_saved_bytes(), "workload": workload,
            })
    return rows if rank == 0 else None


def measure_bubbles(pp_list=(2, 4), m_list=(1, 2, 4, 8), schedules=("gpipe", "1f1b"), *, f_ms: float = 10.0,
                    b_ms: float = 20.0, width: int = 256, mb_rows: int = 16, repeats: int = 3,
                    workload: str = "spin", timeout: float = 600.0) -> list[dict]:
    """Measured bubble fraction per (p, m, schedule) next to (p - 1) / (m + p - 1).

    Each of p stages is one :class:`SyntheticLayer` (forward ``f_ms``, backward ``b_ms``;
    micro-batches of ``mb_rows`` x ``width`` floats), run on p local ranks (one spawn per p).
    Per configuration: one warm-up step, then ``repeats`` steps; the row holds the median and
    the smallest bubble, the median makespan against the ideal (m + p - 1)(f + b), and each
    stage's peak held micro-batches and peak bytes of saved stage inputs + outputs.
    """
    from distrain.launch import spawn

    rows: list[dict] = []
    for p in pp_list:
        out = spawn(_bubble_worker, p, args=(tuple(m_list), tuple(schedules), f_ms, b_ms, width, mb_rows, repeats,
                                              workload), timeout=timeout, threads_per_rank=1)
        rows += out[0]
    return rows


def format_bubble_table(rows: list[dict]) -> str:
    """A markdown table of :func:`measure_bubbles` rows."""
    lines = ["| p | m | schedule | bubble (median) | bubble (min) | (p-1)/(m+p-1) | makespan ms | ideal ms "
             "| peak held per stage | peak saved KiB per stage |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        kib = ", ".join(f"{b / 1024:.0f}" for b in r["peak_saved_bytes"])
        lines.append(f"| {r['p']} | {r['m']} | {r['schedule']} | {r['bubble']:.3f} | {r['bubble_min']:.3f} | "
                     f"{r['expected']:.3f} | {r['makespan_ms']:.0f} | {r['ideal_makespan_ms']:.0f} | "
                     f"{', '.join(map(str, r['peak_held']))} | {kib} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    """``python -m distrain.parallel.pipeline --pp 2 4 --m 1 2 4 8``: print the bubble table."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m distrain.parallel.pipeline", description=main.__doc__)
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b"])
    ap.add_argument("--f-ms", type=float, default=10.0)
    ap.add_argument("--b-ms", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workload", choices=["spin", "sleep"], default="spin")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args(argv)
    rows = measure_bubbles(a.pp, a.m, a.schedules, f_ms=a.f_ms, b_ms=a.b_ms, repeats=a.repeats, workload=a.workload)
    print(format_bubble_table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
