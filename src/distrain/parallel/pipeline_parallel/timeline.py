"""Per-stage timelines of a pipeline step: what ran when, the bubble, memory peaks, traces.

Each rank records a :class:`StageTimeline` during ``pipeline_step`` (``stage.timeline``):
its compute ops ``(kind "F"/"B"/"W", micro-batch, start, end)`` in ``time.perf_counter`` seconds,
the time it spent blocked in receives, and the peaks of what it held for backward.
:func:`collect_timeline` gathers the stages' timelines (``comm.all_gather_data`` or
``comm.gather_data`` on the pipeline's group) into a :class:`PipelineTimeline`, which computes
the bubble fraction and writes a Chrome trace and a Gantt chart.

The benchmark that measures the bubble of equal synthetic stages against (p - 1) / (m + p - 1)
is ``distrain bench pipeline`` (:mod:`distrain.bench.pipeline_bench`).

Clocks: ``perf_counter`` is CLOCK_MONOTONIC on Linux, shared by all processes of one
machine, so stages on one host are on one time axis. Stages on different machines are not;
their trace still shows each stage's own order, but the measured bubble is meaningless there.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel.zero_bubble import zb_h1_bubble


@dataclass
class StageTimeline:
    """One stage's record of one pipeline step (it travels as a dict of data: ``gather_timeline``)."""

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
        """(p - 1) / (m + p - 1), the bubble of equal stages with free communication; under ZB-H1
        (T_F = T_B = T_W) (p - 1) / (3m + p - 1) for m >= p (:func:`.zero_bubble.zb_h1_bubble`);
        interleaved with v chunks per rank ("interleaved(v=2)") (p - 1) / (v m + p - 1): the fill and
        drain take (p - 1) chunk-times of 1/v a stage-time."""
        p, m = self.num_stages, self.num_microbatches
        if self.schedule.startswith("interleaved(v="):
            v = int(self.schedule[len("interleaved(v="):-1])
            return (p - 1) / (v * m + p - 1)
        return zb_h1_bubble(p, m) if self.schedule == "zb-h1" else (p - 1) / (m + p - 1)

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
        """Draw a PNG Gantt chart: one row per stage, forwards blue, backwards green (ZB-H1: input
        gradients green, weight gradients orange), waits hatched."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0, p = self.t0, self.num_stages
        span_ms = max(self.makespan() * 1e3, 1e-9)
        fig, ax = plt.subplots(figsize=(max(6.0, 1.0 + 0.45 * 2 * self.num_microbatches), 0.6 * p + 1.4))
        colors = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452"}
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
        formula = "(p-1)/(vm+p-1)" if self.schedule.startswith("interleaved") else \
            "(p-1)/(m+p-1)" if self.schedule != "zb-h1" else \
            "(p-1)/(3m+p-1)" if self.num_microbatches >= p else "1-3m/(2m+2p-1)"
        ax.set_title(title or (f"{self.schedule}, p={p}, m={self.num_microbatches}: bubble "
                               f"{self.bubble_fraction():.3f} (ideal {formula} = {self.expected_bubble():.3f})"),
                     fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def collect_timeline(timeline: StageTimeline, group=None, dst: int | None = None) -> PipelineTimeline | None:
    """Gather every stage's timeline of one pipeline (collective over ``group``, its pp group).

    ``dst=None``: every rank gets the :class:`PipelineTimeline` (``comm.all_gather_data``).
    ``dst=<global rank>``: to that rank (``comm.gather_data``), the others get None.
    ``group`` must hold exactly the ranks of one pipeline (``topo.pp_group``; None = the world
    when the world is one pipeline).
    """
    from distrain import comm

    mine = dataclasses.asdict(timeline)  # (data only: a record of numbers and strings)
    if dst is None:
        out = comm.all_gather_data(mine, group=group, algorithm=None)
    else:
        out = comm.gather_data(mine, dst=dst, group=group, algorithm=None)
    return PipelineTimeline([StageTimeline(**d) for d in out]) if out is not None else None
