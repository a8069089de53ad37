"""distrain.parallel: one folder per paradigm, each written only on distrain.comm.

    data_parallel/      all-reduce data parallelism: our DistributedDataParallel (ddp.py)
    parameter_server/   data parallelism by parameter servers, sync and async, sharded
                        (ps.py: the protocol; ps_layout.py: roles, shards, exact bytes)
    tensor_parallel/    Megatron column/row split with f/g (layers.py) placed by a per-model
                        plan (plan.py; the GPT's plan is distrain.models.gpt.plan), and
                        sequence parallelism (sequence.py)
    pipeline_parallel/  GPipe and 1F1B (schedule.py: pure planning; pipeline.py: the
                        executor; timeline.py: bubble, traces), interleaved 1F1B
                        (interleaved.py)
    zero/               ZeRO stages 1-3: optimizer state, gradients, parameters sharded
                        over the data-parallel group (engine.py: Zero; layout.py: flat shards)
    parallelize.py      tensor, then pipeline, then data parallel on one model

Each folder's docstring maps its files to the seeds' diagrams. Imports go downwards only:
parallelize -> the paradigm folders -> distrain.comm; the folders do not import each other.
Benchmarks live in distrain.bench.
"""

from distrain.parallel.data_parallel import DistributedDataParallel
from distrain.parallel.parallelize import ParallelModel, parallelize

__all__ = ["DistributedDataParallel", "ParallelModel", "parallelize"]
