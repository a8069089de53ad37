"""Two baselines that benchmarks compare the grid engine with: torch's DDP (``torch-ddp``) and ``local``.

``torch-ddp`` is the same data-parallel job as ``--strategy ddp`` on torch's own
``DistributedDataParallel`` (its C++ reducer and Gloo/NCCL), so ``distrain bench train`` can set our
DDP beside it. ``local`` is the same job with no gradient exchange at all: every rank steps its own
replica on its own slice (so the replicas drift apart). It is a baseline for benchmarks, not a way to
train: its step time is the floor of every data-parallel step on the same ranks, so 1 - local / step
is the share of a step that communication and its bookkeeping cost (``distrain bench train`` reports
it for torch DDP too, whose wait is not visible). Everything else is SingleEngine's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain.trainer.engines.single import SingleEngine


class TorchDDPEngine(SingleEngine):
    def wrap(self, model):
        from distrain.models.registry import model_ep_plan
        from distrain.parallel.expert_parallel import sum_router_counts

        if self.world > 1:  # a mixture of experts: the router's counts over the world, as the grid engine's DDP
            sum_router_counts(model, model_ep_plan(model), dist.group.WORLD)
        device = next(model.parameters()).device
        ids = [device.index] if device.type == "cuda" else None  # one device per rank
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=self.cfg.bucket_cap_mb)

    def describe(self) -> str:
        return "torch-ddp"


class LocalEngine(SingleEngine):
    """P ranks, each on its slice of the global batch, with no communication (a benchmark floor)."""

    def describe(self) -> str:
        return "local (no gradient exchange)"
