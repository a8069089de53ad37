"""distrain.parallel: one module per paradigm, each written only on distrain.comm.

    ddp.py          data parallel by all-reduce (our DistributedDataParallel)
    ps.py           data parallel by parameter server (sync and async, sharded; ps_layout.py)
    tensor.py       tensor parallel (Megatron column/row split, f/g; tensor_layers.py)
    pipeline.py     pipeline parallel (GPipe, 1F1B; pipeline_schedule.py, pipeline_timeline.py)
    parallelize.py  tensor, then pipeline, then data parallel on one model
"""

from distrain.parallel.ddp import DistributedDataParallel
from distrain.parallel.parallelize import ParallelModel, parallelize

__all__ = ["DistributedDataParallel", "ParallelModel", "parallelize"]
