"""distrain.parallel: one module per paradigm, each written only on distrain.comm.

    ddp.py   data parallel by all-reduce (our DistributedDataParallel)
    ps.py    data parallel by parameter server (sync and async, sharded)
"""

from distrain.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
