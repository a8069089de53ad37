"""Pipeline parallelism: the model's layer list cut into contiguous stages, one per rank,
with micro-batches flowing through them (GPipe, 1F1B, interleaved 1F1B, zero-bubble ZB-H1).

Seed ``001`` "Model Parallelism / Pipeline Parallelism": the 12 layers on 3 GPUs diagram
(``1..4 | 5..8 | 9..12``) is :func:`partition`; the micro-batches that let the stages
overlap are :func:`split_microbatches` and the schedules of :func:`schedule_ops`. Seed
``004`` "Message Passing": stages talk only by point-to-point send/recv of activations
(forward) and their gradients (backward).

    schedule.py  pure planning: partition, micro-batches, GPipe / 1F1B op lists, and
                 simulate() (the Kahn-network argument that the executor cannot deadlock)
    pipeline.py  PipelineStage (this rank's layers) and pipeline_step (runs the schedule
                 with isend / recv between neighbouring stages)
    interleaved.py  interleaved 1F1B (v model chunks per rank, Megatron SC'21): its op order,
                 simulation, InterleavedStage and interleaved_step; bubble (p-1)/(v*m)
    zero_bubble.py  ZB-H1 (Qi et al. 2024): op order with B / W split, bubble (p-1)/(3m+p-1)
    weight_grad.py  the B / W split: linear layers' weight gradients deferred to a per-stage store
    forward_only.py  evaluation: forwards only, first stage -> last stage, no autograd, eval
                 mode, random generators and the last step's timeline untouched
    timeline.py  what ran when on each stage: bubble fraction, held activations, Chrome
                 trace and Gantt chart

Imports go one way: forward_only -> pipeline, interleaved -> pipeline, interleaved -> schedule -> timeline -> zero_bubble;
pipeline -> weight_grad. The bubble benchmark is
``distrain bench pipeline`` (distrain.bench.pipeline_bench).
"""

from distrain.parallel.pipeline_parallel.forward_only import MAX_SENDS_IN_FLIGHT, evaluation_mode, forward_only
from distrain.parallel.pipeline_parallel.interleaved import (
    InterleavedStage, interleaved_bubble, interleaved_ops, interleaved_step, simulate_interleaved,
)
from distrain.parallel.pipeline_parallel.pipeline import DEFAULT_TAG_BASE, MicrobatchHooks, PipelineStage, pipeline_step
from distrain.parallel.pipeline_parallel.schedule import (
    SCHEDULES, SPLIT_BACKWARD, ScheduleDeadlock, check_schedule, ideal_bubble, layer_costs, partition, peak_in_flight,
    schedule_ops, simulate, split_microbatches, stage_program, warmup_forwards,
)
from distrain.parallel.pipeline_parallel.timeline import PipelineTimeline, StageTimeline, collect_timeline
from distrain.parallel.pipeline_parallel.weight_grad import WeightGradStore, defer_weight_grads, deferral
from distrain.parallel.pipeline_parallel.zero_bubble import zb_h1_bubble, zb_h1_makespan, zb_h1_ops

__all__ = [
    "DEFAULT_TAG_BASE", "InterleavedStage", "MicrobatchHooks", "PipelineStage", "PipelineTimeline", "SCHEDULES", "ScheduleDeadlock", "StageTimeline",
    "MAX_SENDS_IN_FLIGHT", "evaluation_mode", "forward_only",
    "check_schedule", "collect_timeline", "ideal_bubble", "layer_costs", "partition", "peak_in_flight",
    "pipeline_step", "schedule_ops", "simulate", "split_microbatches", "stage_program", "warmup_forwards",
    "interleaved_bubble", "interleaved_ops", "interleaved_step", "simulate_interleaved",
    "SPLIT_BACKWARD", "WeightGradStore", "defer_weight_grads", "deferral", "zb_h1_bubble", "zb_h1_makespan",
    "zb_h1_ops",
]
