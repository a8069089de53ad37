"""Deprecated: ``distrain.parallel.pipeline_timeline`` is now
:mod:`distrain.parallel.pipeline_parallel.timeline`.

Kept for one release so that old imports keep working: importing it warns (DeprecationWarning)
with the new path. It imports only its new module.
"""

import warnings

from distrain.parallel.pipeline_parallel.timeline import (  # noqa: F401 (re-exported)
    PipelineTimeline, StageTimeline, collect_timeline,
)

__all__ = [
    "PipelineTimeline", "StageTimeline", "collect_timeline",
]

warnings.warn(
    "distrain.parallel.pipeline_timeline is deprecated and will be removed in the next release; "
    "import distrain.parallel.pipeline_parallel.timeline instead",
    DeprecationWarning, stacklevel=2)


# old names that live elsewhere now (named, not imported: a shim imports only its new module)
_MOVED = {
    "SyntheticLayer": "distrain.bench.pipeline_bench",
    "measure_bubbles": "distrain.bench.pipeline_bench",
    "format_bubble_table": "distrain.bench.pipeline_bench",
    "main": "the command `distrain bench pipeline`",
}


def __getattr__(name: str):
    if name in _MOVED:
        raise AttributeError(f"{__name__}.{name} moved to {_MOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
