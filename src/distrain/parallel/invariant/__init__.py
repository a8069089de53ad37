"""Layout-invariant training: the same bits on one process or many (docs/determinism.md).

Three parts: units of work of a fixed size (units.py), gradient sums in int64 at shared per-parameter
exponents (fixed_point.py, gradients.py), and a step that runs the units and sums their losses exactly
(step.py); with a pipeline, its micro-batches are the units (pipeline.py)."""

from distrain.parallel.invariant.fixed_point import exact_sum, quantize, scale_exponents
from distrain.parallel.invariant.gradients import FixedPointGradients
from distrain.parallel.invariant.pipeline import InvariantPipelineStep, StageGradients
from distrain.parallel.invariant.step import InvariantStep, clip_exact
from distrain.parallel.invariant.units import default_units, replica_units, unit_seed

__all__ = ["FixedPointGradients", "InvariantPipelineStep", "InvariantStep", "StageGradients", "clip_exact",
           "default_units", "exact_sum",
           "quantize", "replica_units", "scale_exponents", "unit_seed"]
