"""Data parallel by all-reduce: our DistributedDataParallel (``ddp``) and torch's (``torch-ddp``).

The model is replicated; the wrapper averages gradients over all ranks during backward
(reverse-order buckets, distrain.parallel's DDP), so the optimizer steps are identical on
every rank. Everything else is SingleEngine's.

``local`` is the same job with no gradient exchange at all: every rank steps its own replica
on its own slice (so the replicas drift apart). It is a baseline for benchmarks, not a way
to train: its step time is the floor of every data-parallel step on the same ranks, so
1 - local / step is the share of a step that communication and its bookkeeping cost
(``distrain bench train`` reports it for torch DDP too, whose wait is not visible).
"""

from __future__ import annotations

import torch

from distrain.trainer.engines.single import SingleEngine


class DDPEngine(SingleEngine):
    def wrap(self, model):
        from distrain.parallel import DistributedDataParallel

        c = self.cfg
        return DistributedDataParallel(model, algorithm=c.algorithm, bucket_cap_mb=c.bucket_cap_mb,
                                       compression=c.compression)

    def describe(self) -> str:
        return f"ddp ({self.cfg.algorithm})"


class TorchDDPEngine(SingleEngine):
    def wrap(self, model):
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None  # one device per rank
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.cfg.bucket_cap_mb)

    def describe(self) -> str:
        return "torch-ddp"


class LocalEngine(SingleEngine):
    """P ranks, each on its slice of the global batch, with no communication (a benchmark floor)."""

    def describe(self) -> str:
        return "local (no gradient exchange)"
