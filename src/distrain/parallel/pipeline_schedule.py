"""Deprecated: ``distrain.parallel.pipeline_schedule`` is now
:mod:`distrain.parallel.pipeline_parallel.schedule`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.pipeline_parallel.schedule import (  # noqa: F401 (re-exported)
    SCHEDULES, ScheduleDeadlock, check_schedule, ideal_bubble, layer_costs, partition,
    peak_in_flight, schedule_ops, simulate, split_microbatches, stage_program, warmup_forwards,
)

__all__ = [
    "SCHEDULES", "ScheduleDeadlock", "check_schedule", "ideal_bubble", "layer_costs",
    "partition", "peak_in_flight", "schedule_ops", "simulate", "split_microbatches",
    "stage_program", "warmup_forwards",
]

warnings.warn(
    "distrain.parallel.pipeline_schedule is deprecated and will be removed in the next release; "
    "import distrain.parallel.pipeline_parallel.schedule instead",
    DeprecationWarning, stacklevel=2)
