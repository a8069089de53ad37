"""Deprecated: ``distrain.parallel.pipeline`` is now :mod:`distrain.parallel.pipeline_parallel`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.pipeline_parallel import (  # noqa: F401 (re-exported)
    DEFAULT_TAG_BASE, PipelineStage, PipelineTimeline, SCHEDULES, ScheduleDeadlock,
    StageTimeline, check_schedule, collect_timeline, ideal_bubble, layer_costs, partition,
    peak_in_flight, pipeline_step, schedule_ops, simulate, split_microbatches, stage_program,
    warmup_forwards,
)

__all__ = [
    "DEFAULT_TAG_BASE", "PipelineStage", "PipelineTimeline", "SCHEDULES", "ScheduleDeadlock",
    "StageTimeline", "check_schedule", "collect_timeline", "ideal_bubble", "layer_costs",
    "partition", "peak_in_flight", "pipeline_step", "schedule_ops", "simulate",
    "split_microbatches", "stage_program", "warmup_forwards",
]

warnings.warn(
    "distrain.parallel.pipeline is deprecated and will be removed in the next release; "
    "import distrain.parallel.pipeline_parallel instead",
    DeprecationWarning, stacklevel=2)


# old names that live elsewhere now (named, not imported: a shim imports only its new module)
_MOVED = {
    "measure_bubbles": "distrain.bench.pipeline_bench",
    "format_bubble_table": "distrain.bench.pipeline_bench",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
