"""Data parallelism by all-reduce: every rank holds the whole model, reads its own slice of the
batch, and the gradients are averaged before each optimizer step.

Seeds: ``001`` "Data Parallelism (DP, DDP)" (the 8-step DP list versus DDP's all-reduce of local
gradients), ``002`` "torch.nn.DistributedDataParallel (DDP)", and ``003`` "All-Reduce
Architecture" (the ring and tree all-reduce diagrams: which algorithm a bucket uses is the
``algorithm=`` argument, implemented in :mod:`distrain.comm`).

    ddp.py   DistributedDataParallel: parameters broadcast from the group's first rank (DP
             step 2, once), gradient buckets all-reduced during backward (DDP's overlap),
             ``no_sync()`` for gradient accumulation.
"""

from distrain.parallel.data_parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
