"""Data parallelism by all-reduce: every rank holds the whole model, reads its own slice of the
batch, and the gradients are averaged before each optimizer step.

Seeds: ``001`` "Data Parallelism (DP, DDP)" (the 8-step DP list versus DDP's all-reduce of local
gradients), ``002`` "torch.nn.DistributedDataParallel (DDP)", and ``003`` "All-Reduce
Architecture" (the ring and tree all-reduce diagrams: which algorithm a bucket uses is the
``algorithm=`` argument, implemented in :mod:`distrain.comm`).

    ddp.py         DistributedDataParallel: parameters broadcast from the group's first rank (DP
                   step 2, once), gradient buckets all-reduced during backward (DDP's overlap),
                   ``no_sync()`` for gradient accumulation.
    buckets.py     many tensors in one flat buffer: the gradient buckets' plan, the coalesced broadcast.
    comm_hooks.py  ``register_comm_hook``'s bucket and our hooks on distrain.comm: allreduce,
                   fp16/bf16 compression; powersgd.py: PowerSGD (Vogels et al. 2019).
    join.py        ``join()``: ranks with fewer batches answer the others' all-reduces with zeros.
    accumulate.py  ``accumulate_gradients``: a part of the batch in equal chunks, synchronised once.
"""

from distrain.parallel.data_parallel.accumulate import accumulate_gradients
from distrain.parallel.data_parallel.comm_hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from distrain.parallel.data_parallel.ddp import DistributedDataParallel
from distrain.parallel.data_parallel.join import Join
from distrain.parallel.data_parallel.powersgd import PowerSGDState, powersgd_hook

__all__ = ["DistributedDataParallel", "GradBucket", "Join", "PowerSGDState", "accumulate_gradients", "allreduce_hook",
           "bf16_compress_hook", "fp16_compress_hook", "powersgd_hook"]
