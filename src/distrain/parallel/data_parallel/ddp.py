"""Our DistributedDataParallel: gradient buckets all-reduced during the backward pass.

The design of torch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020), written on distrain.comm so the all-reduce algorithm is
selectable (native, star, ring, tree):

1. On wrapping, parameters and buffers are broadcast from the group's first rank, so every
   replica starts from the same weights.
2. Parameters are packed, in *reverse* registration order (roughly the order in which
   backward produces their gradients), into buckets of at most ``bucket_cap_mb`` (the
   first one at most 1 MiB, so that communication starts early).
3. A post-accumulate-grad hook on every parameter marks it ready; when a bucket is full
   its gradients are copied into the bucket's flat buffer, pre-divided by the group size,
   and all-reduced (sum) *asynchronously*, so communication overlaps the rest of backward.
   Buckets are launched strictly in index order, so every rank issues the same collectives
   in the same order even if its gradients arrive in another order.
4. A callback queued on the autograd engine runs at the end of backward: it launches what
   is left, waits for every bucket, and writes the averaged gradients back to ``.grad``.
   The optimizer step that follows sees averaged gradients, as with torch DDP.

``no_sync()`` skips 3-4 (gradients accumulate locally; the next synchronized backward
all-reduces the sum). A parameter that got no gradient raises an error naming it, unless
``find_unused_parameters=True``, which all-reduces zeros for it instead. ``compression=
"bf16"|"fp16"`` all-reduces the buckets in that dtype (half the bytes, lower precision).

Contract: every rank wraps the same model (same parameter shapes and order) and runs the
same number of synchronized backward passes.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm
from distrain.errors import CommError, ConfigError

FIRST_BUCKET_BYTES = 1 << 20
_COMPRESSION = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor  # flat, the dtype of the parameters
    views: list[torch.Tensor] = field(default_factory=list)  # buffer slices, one per param
    pending: int = 0
    handle: object | None = None
    wire: torch.Tensor | None = None  # what is all-reduced (buffer, or its compressed copy)


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over ``group``."""

    def __init__(self, module: nn.Module, group=None, algorithm: str = "ring", bucket_cap_mb: float = 25,
                 find_unused_parameters: bool = False, compression: str | None = None):
        super().__init__()
        if algorithm not in comm.ALGORITHM_NAMES:
            raise ConfigError(f"DistributedDataParallel: unknown algorithm {algorithm!r}; "
                              f"use one of {', '.join(comm.ALGORITHM_NAMES)}")
        if compression not in _COMPRESSION:
            raise ConfigError(f"DistributedDataParallel: compression must be None, 'bf16' or 'fp16', got {compression!r}")
        if bucket_cap_mb <= 0:
            raise ConfigError(f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = module
        self.group = group
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        self.wire_dtype = _COMPRESSION[compression]
        self.world = dist.get_world_size(group)
        self.src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        self.comm_wait_s = 0.0  # time the last backward spent blocked on communication
        self._sync = True
        self._step_sync = True
        self._queued = False

        self._broadcast_state()
        self._buckets = self._build_buckets(bucket_cap_mb * 2 ** 20)
        self._bucket_of: dict[int, int] = {}
        for b, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._ready: set[int] = set()
        self._next_launch = 0

    # -- set-up ------------------------------------------------------------------------------
    def _broadcast_state(self) -> None:
        with torch.no_grad():
            for t in list(self.module.parameters()) + list(self.module.buffers()):
                comm.broadcast(t.data, src=self.src, group=self.group, algorithm=self.algorithm)

    def _build_buckets(self, cap_bytes: float) -> list[_Bucket]:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("DistributedDataParallel: the module has no parameter that requires grad")
        buckets, cur, size = [], [], 0
        for n, p in reversed(named):
            nbytes = p.numel() * p.element_size()
            # The first bucket (the last layers, whose gradients come first) is capped at
            # 1 MiB, as in torch DDP: its all-reduce starts early and overlaps the rest.
            cap = min(cap_bytes, FIRST_BUCKET_BYTES) if not buckets else cap_bytes
            if cur and (size + nbytes > cap or p.dtype != cur[0][1].dtype):
                buckets.append(cur)
                cur, size = [], 0
            cur.append((n, p))
            size += nbytes
        buckets.append(cur)
        out = []
        for group in buckets:
            params = [p for _, p in group]
            buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, off = [], 0
            for p in params:
                views.append(buf[off:off + p.numel()])
                off += p.numel()
            out.append(_Bucket(params=params, names=[n for n, _ in group], buffer=buf, views=views))
        return out

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (the first bucket holds the last layers)."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self._buckets]

    # -- forward / backward ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # Like torch DDP, whether this step synchronizes is decided when its forward runs.
        self._step_sync = self._sync
        self._ready.clear()
        self._next_launch = 0
        self._queued = False
        for b in self._buckets:
            b.pending = len(b.params)
            b.handle = None
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally; the first backward after the block all-reduces the sum."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        # Skipped under no_sync(), whether the forward ran through this wrapper or not (a
        # pipeline stage calls its layers directly and syncs with allreduce_gradients()).
        if not (self._step_sync and self._sync) or id(p) in self._ready:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._ready.add(id(p))
        bucket = self._buckets[self._bucket_of[id(p)]]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        with torch.no_grad():
            for p, v in zip(b.params, b.views):
                if p.grad is None:
                    v.zero_()  # unused on this rank (find_unused_parameters=True)
                else:
                    v.copy_(p.grad.reshape(-1))
            # Pre-divide, then sum: the average without a final pass, and no fp16 overflow.
            b.buffer.div_(self.world)
            b.wire = b.buffer if self.wire_dtype is None else b.buffer.to(self.wire_dtype)
            b.handle = comm.all_reduce(b.wire, op="sum", group=self.group, async_op=True, algorithm=self.algorithm)

    def _finish_backward(self) -> None:
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in self._ready]
        if missing and not self.find_unused_parameters:
            raise CommError(
                f"DistributedDataParallel: parameter(s) {missing} received no gradient in this backward pass; "
                f"make every parameter take part in the loss, or pass find_unused_parameters=True"
            )
        for b in self._buckets:
            b.pending = 0
        self._launch_ready()
        self._wait_and_write_back()

    def allreduce_gradients(self) -> None:
        """Average the gradients accumulated so far over the group, now.

        For callers that run backward passes under ``no_sync()`` and decide themselves when
        to synchronize, e.g. a pipeline step over several micro-batches (parallelize.py).
        Parameters without a gradient contribute zeros.
        """
        for b in self._buckets:
            self._launch(b)
        self._wait_and_write_back()

    def _wait_and_write_back(self) -> None:
        t0 = time.perf_counter()
        for b in self._buckets:
            b.handle.wait()
        self.comm_wait_s = time.perf_counter() - t0
        with torch.no_grad():
            for b in self._buckets:
                if b.wire is not b.buffer:
                    b.buffer.copy_(b.wire)
                for p, v in zip(b.params, b.views):
                    if p.grad is None:
                        p.grad = v.view_as(p).clone()
                    else:
                        p.grad.copy_(v.view_as(p))
