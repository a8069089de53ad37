"""Our DistributedDataParallel: gradient buckets all-reduced during the backward pass.

The design of torch DDP (Li et al., "PyTorch Distributed: Experiences on Accelerating Data
Parallel Training", VLDB 2020), written on distrain.comm so the all-reduce algorithm is
selectable (native, star, ring, tree):

1. On wrapping, parameters and buffers are broadcast from the group's first rank, so every
   replica starts from the same weights.
2. Parameters are packed, in *reverse* registration order (roughly the order in which
   backward produces their gradients), into buckets of at most ``bucket_cap_mb`` (the
   first one at most 1 MiB, so that communication starts early; buckets.py).
3. A post-accumulate-grad hook on every parameter marks it ready; when a bucket is full
   its gradients are copied into the bucket's flat buffer, pre-divided by the group size,
   and all-reduced (sum) *asynchronously*, so communication overlaps the rest of backward.
   Buckets are launched strictly in index order, so every rank issues the same collectives
   in the same order even if its gradients arrive in another order.
4. A callback queued on the autograd engine runs at the end of backward: it launches what
   is left, waits for every bucket, and writes the averaged gradients back to ``.grad``.
   The optimizer step that follows sees averaged gradients, as with torch DDP.

Before each forward the buffers (BatchNorm running statistics) are broadcast from the
group's first rank, as torch DDP does (``broadcast_buffers`` / ``forward_sync_buffers``), so
every replica normalizes evaluation batches alike. ``gradient_as_bucket_view=True`` leaves
``.grad`` as views into the buckets (no copy back, one buffer less).

On the shared-memory transport the buckets live in symmetric memory
(``comm.symmetric_empty``: every peer maps them), so a bucket's all-reduce works in place in
every rank's bucket: each rank reduces 1/P of it, read straight from the peers' buckets, and
writes the sum into all of them (no copy through the transport's slots; the bits are the same).
With ``gradient_as_bucket_view=True`` the averaged gradients then stay where they are: the
gradients live in the shared segment.

``no_sync()`` skips 3-4 (gradients accumulate locally; the next synchronized backward
all-reduces the sum). A parameter that got no gradient raises an error naming it, unless
``find_unused_parameters=True``, which all-reduces zeros for it instead. ``compression=
"bf16"|"fp16"`` all-reduces the buckets in that dtype (half the bytes, lower precision).
``register_comm_hook(state, hook)``: a hook reduces each bucket instead (comm_hooks.py: torch's
contract; allreduce, fp16, bf16, PowerSGD); ``join()``: uneven numbers of batches (join.py).
``carry(values)``: a few scalars averaged over the group with the next backward's gradients, in
the last bucket's all-reduce (an elastic job's quorum rides there: no collective of its own).

Contract: every rank wraps the same model (same parameter shapes and order) and runs the
same number of synchronized backward passes.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from distrain import comm
from distrain.comm.core.util import nbytes
from distrain.errors import CommError, ConfigError
from distrain.parallel.data_parallel import comm_hooks
from distrain.parallel.data_parallel.buckets import Bucket, coalesced_batches, plan_buckets, views_of
from distrain.parallel.data_parallel.join import Join
from distrain.parallel.data_parallel.torch_options import torch_options, unsupported

_COMPRESSION = {None: None, "none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over the group.

    Takes torch DDP's constructor arguments, in torch's order and with torch's meaning (see
    :func:`torch_options.torch_options`), plus distrain's own keyword-only ones: ``algorithm`` (native,
    star, ring, tree), ``compression`` (None, "bf16", "fp16") and ``group`` (= process_group).
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0,
                 broadcast_buffers: bool | None = None, init_sync: bool = True, process_group=None,
                 bucket_cap_mb: float | None = None, find_unused_parameters: bool = False,
                 check_reduction: bool = False, gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params=None, param_to_hook_all_reduce=None, mixed_precision=None,
                 device_mesh=None, skip_all_reduce_unused_params: bool = False, bucket_cap_mb_list=None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None, *,
                 group=None, algorithm: str = "ring", compression: str | None = None):
        super().__init__()
        if algorithm not in comm.ALGORITHM_NAMES:
            raise ConfigError(f"DistributedDataParallel: unknown algorithm {algorithm!r}; "
                              f"use one of {', '.join(comm.ALGORITHM_NAMES)}")
        if compression not in _COMPRESSION:
            raise ConfigError(f"DistributedDataParallel: compression must be None, 'bf16' or 'fp16', got {compression!r}")
        bucket_cap_mb = 25.0 if bucket_cap_mb is None else bucket_cap_mb
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or bucket_cap_mb <= 0:
            raise ConfigError(f"DistributedDataParallel: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                    param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                    device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                    bucket_cap_mb_list=bucket_cap_mb_list)
        opts = torch_options(module, device_ids, output_device, dim, broadcast_buffers, forward_sync_buffers,
                             check_reduction, process_group, group)
        self.module = module
        self._ignored = frozenset(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))  # torch's; experts (ep)
        self.group = opts.group
        self.device_ids, self.output_device, self.dim = opts.device_ids, opts.output_device, dim
        self._input_device = opts.input_device
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph  # the same parameters unused every step: no error for them
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy  # torch's flag; our copies are always batched per bucket
        self.forward_sync_buffers = opts.forward_sync_buffers
        self.wire_dtype = _COMPRESSION[compression]
        self.world = dist.get_world_size(self.group)
        self.src = dist.get_process_group_ranks(self.group or dist.group.WORLD)[0]
        self.comm_wait_s = 0.0  # the last backward's time from its end of compute to averaged gradients
        self._sync = True
        self._step_sync = True
        self._queued = False
        self.require_forward_buffer_sync = True  # torch's require_forward_param_sync (join() sets it too)
        self._hook, self._hook_state, self._join, self._backward_seen = None, None, None, False  # comm hook, join()
        self._div = self.world  # gradients are averaged over this many ranks (join() may lower it)
        self._carry: torch.Tensor | None = None  # values riding in the last bucket (carry())
        self._carried: torch.Tensor | None = None
        self._carry_slots = 0  # extra elements at the end of the last bucket, once carry() asked for them

        if init_sync:
            self.broadcast_state(buffers=opts.init_sync_buffers)
        self._buckets = self._build_buckets(bucket_cap_mb * 2 ** 20)
        self._bucket_of: dict[int, int] = {}
        for b, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._ready: set[int] = set()
        self._next_launch = 0

    @property
    def broadcast_buffers(self) -> bool:
        """torch's name for :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    # -- set-up ------------------------------------------------------------------------------
    def broadcast_state(self, params: bool = True, buffers: bool = True, src: int | None = None) -> None:
        """Parameters and/or buffers (BatchNorm running stats, ...) from global rank ``src``
        (default: the group's first) to every rank: one broadcast per dtype of them all packed
        together (as torch's ``_broadcast_coalesced``), so a model with a buffer per layer pays
        one collective before each forward, not one per layer."""
        tensors = ([p for n, p in self.module.named_parameters() if n not in self._ignored] if params else []) + \
            ([b for n, b in self.module.named_buffers() if n not in self._ignored] if buffers else [])
        with torch.no_grad():
            for group in coalesced_batches(tensors):
                flat = torch.cat([t.reshape(-1) for t in group])
                comm.broadcast(flat, src=self.src if src is None else src, group=self.group, algorithm=self.algorithm)
                torch._foreach_copy_(group, [v.view_as(t) for v, t in zip(flat.split([t.numel() for t in group]),
                                                                            group)])

    def _build_buckets(self, cap_bytes: float) -> list[Bucket]:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in self._ignored]
        if not named:
            raise ConfigError("DistributedDataParallel: the module has no parameter that requires grad")
        out = []
        for group in plan_buckets(named, cap_bytes):  # (reverse order, the first bucket at most 1 MiB)
            params = [p for _, p in group]
            buf = self._bucket_buffer(sum(p.numel() for p in params), params[0])
            out.append(Bucket(params=params, names=[n for n, _ in group], buffer=buf, views=views_of(buf, params),
                              index=len(out)))
        return out

    def _bucket_buffer(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed flat bucket; in symmetric memory (the module docstring) for CPU parameters
        all-reduced as they are by the native algorithm (every rank builds the same buckets in
        the same order, as the collective allocation needs; other transports give plain memory)."""
        if like.device.type == "cpu" and self.wire_dtype is None and self.algorithm == "native":
            return comm.symmetric_empty(n, dtype=like.dtype, group=self.group).zero_()
        return torch.zeros(n, dtype=like.dtype, device=like.device)

    @property
    def buckets(self) -> list[Bucket]:
        """The gradient buckets, in launch order (to read: DDP fills and reduces them)."""
        return self._buckets

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (the first bucket holds the last layers)."""
        return [nbytes(b.buffer) for b in self._buckets]

    # -- values that ride with the gradients -----------------------------------------------------
    @property
    def can_carry(self) -> bool:
        """Whether :meth:`carry` works: the buckets are all-reduced as they are (no comm hook, no
        compression) and the last one holds float32/float64 values."""
        return self._hook is None and self.wire_dtype is None and \
            self._buckets[-1].buffer.dtype in (torch.float32, torch.float64)

    def carry(self, values: torch.Tensor) -> None:
        """Average ``values`` (a few scalars) over the group together with the next synchronized
        backward's gradients: they ride in the last bucket's all-reduce, pre-divided like the
        gradients (x * (1/P), summed), so agreeing on them costs no collective of its own. Every rank
        calls it with as many values, before that backward; :meth:`carried` gives the averages after
        it (in the bucket's dtype: float32 values are averaged in float32). The first call adds the
        slots to the last bucket on every rank alike (a collective allocation in symmetric memory)."""
        if not self.can_carry:
            raise ConfigError("DistributedDataParallel.carry: the buckets are reduced by a comm hook or compressed, "
                              "or the last one is not float32/float64; agree on the values with their own all_reduce")
        values = values.detach().reshape(-1)
        if values.numel() != self._carry_slots:
            self._grow_last_bucket(values.numel())
        self._carry, self._carried = values, None

    def carried(self) -> torch.Tensor | None:
        """The group's averages of the values given to :meth:`carry` before the last backward (float64)."""
        return self._carried

    def _grow_last_bucket(self, k: int) -> None:
        b = self._buckets[-1]
        n = sum(v.numel() for v in b.views)
        buf = self._bucket_buffer(n + k, b.buffer)
        buf[:n].copy_(b.buffer[:n])
        b.buffer, b.views = buf, views_of(buf, b.params)
        self._carry_slots = k

    # -- forward / backward ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # As torch DDP: buffers come from the first rank before the forward, unless the previous
        # forward ran under no_sync() or without grad (torch's require_forward_param_sync).
        sync_buffers = self.forward_sync_buffers and self.require_forward_buffer_sync
        src = self._join.notify(self._sync and torch.is_grad_enabled(), sync_buffers) if self._join else self.src
        if sync_buffers:
            self.broadcast_state(params=False, src=src)
        if self.device_ids:  # a single-device accelerator module: inputs go to device_ids[0]
            dev = self._input_device
            args, kwargs = tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, (args, kwargs))
        # Like torch DDP, whether this step synchronizes is decided when its forward runs.
        self._step_sync = self._sync
        self._ready.clear()
        self._next_launch = 0
        self._queued = False
        for b in self._buckets:
            b.pending = len(b.params)
            b.handle = None
        out = self.module(*args, **kwargs)
        self.require_forward_buffer_sync = torch.is_grad_enabled() and self._sync
        return out

    def register_comm_hook(self, state, hook) -> None:
        """torch DDP's: ``hook(state, bucket) -> Future[Tensor]`` reduces each bucket (comm_hooks.py)."""
        comm_hooks.check_registration(hook, self._hook, self._backward_seen, self.wire_dtype)
        self._hook, self._hook_state = hook, state

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's: a rank out of data answers the others' all-reduces with zeros (join.py)."""
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

    def set_join(self, join: Join | None) -> None:
        """The join() context this model's forward reports to (None: none, gradients divided by the
        group size again); a second one while one is active is refused."""
        if join is not None and self._join is not None:
            raise ConfigError("DistributedDataParallel.join: already inside this model's join(); "
                              "enter it once per training loop")
        self._join = join
        if join is None:
            self._div = self.world

    def set_grad_divisor(self, n: int) -> None:
        """Average the next backward's gradients over ``n`` ranks (join(): the active ones, or the group size)."""
        self._div = n

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
        self._backward_seen = True
        if not (self._step_sync and self._sync) or id(p) in self._ready:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        self._ready.add(id(p))
        bucket = self._buckets[self._bucket_of[id(p)]]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, wait: bool = False) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch], wait)
            self._next_launch += 1

    def _launch(self, b: Bucket, wait: bool = False) -> None:
        """Copy the bucket's gradients in and start its all-reduce: asynchronously during backward
        (the group's worker runs it while backward goes on), or with ``wait`` on this thread: at
        the end of backward nothing is left to overlap, and handing the bucket to the worker and
        back would cost two thread wake-ups, each a scheduler's time slice when cores are busy."""
        # Pre-divide, then sum: the average without a final pass, and no fp16 overflow. The
        # gradients that are not yet the bucket's views are copied in with one fused copy and
        # multiplied by 1/P in the bucket (the same bits as torch's reducer, which multiplies
        # while copying: x * (1/P) either way); one that already is the view
        # (gradient_as_bucket_view) is divided. A comm hook gets the plain gradients (it averages
        # them itself): then the factor is 1.
        div = self._div if self._hook is None else 1
        with torch.no_grad():
            dst, src = [], []
            for p, v in zip(b.params, b.views):
                if p.grad is None:
                    v.zero_()  # unused on this rank (find_unused_parameters=True)
                elif p.grad.data_ptr() != v.data_ptr():  # not already the bucket view
                    dst.append(v)
                    src.append(p.grad.reshape(-1))
                elif div != 1:
                    v.div_(div)
            if dst:  # one fused copy per bucket, then the scale: the same bits as torch.mul(g, 1/P, out=v)
                torch._foreach_copy_(dst, src)
                if div != 1:
                    torch._foreach_mul_(dst, 1.0 / div)
            if self._carry_slots and b.index == len(self._buckets) - 1:  # the values riding with the gradients
                tail = b.buffer[-self._carry_slots:]
                tail.copy_(self._carry if self._carry is not None else torch.zeros(self._carry_slots))
                tail.mul_(1.0 / self._div)
            b.wire, b.handle = self.reduce_bucket(b.index, b.buffer, wait)

    def reduce_bucket(self, index: int, buffer: torch.Tensor, wait: bool = False) -> tuple[torch.Tensor, object]:
        """Reduce bucket ``index`` whose flat gradient is ``buffer`` as backward does: through the
        registered comm hook, else an all-reduce (sum) in the wire dtype with the model's algorithm.
        Returns (the tensor reduced, its handle: None when ``wait`` ran it on this thread). join()'s
        joined ranks call it with zeros, through the same collective as the active ranks."""
        if self._hook is not None:  # (register_comm_hook refuses compression: the wire is the buffer)
            bucket = comm_hooks.GradBucket(index, len(self._buckets), buffer, self._buckets[index].params, self.group,
                                           self.algorithm)
            return buffer, comm_hooks.run_hook(self._hook, self._hook_state, bucket)
        wire = buffer if self.wire_dtype is None else buffer.to(self.wire_dtype)
        return wire, comm.all_reduce(wire, op="sum", group=self.group, async_op=not wait, algorithm=self.algorithm)

    def _finish_backward(self) -> None:
        t0 = time.perf_counter()
        missing = [] if len(self._ready) == len(self._bucket_of) else \
            [n for n, p in self.module.named_parameters() if id(p) in self._bucket_of and id(p) not in self._ready]
        if missing and not (self.find_unused_parameters or self.static_graph):
            raise CommError(
                f"DistributedDataParallel: parameter(s) {missing} received no gradient in this backward pass; "
                f"make every parameter take part in the loss, or pass find_unused_parameters=True"
            )
        for b in self._buckets:
            b.pending = 0
        self._launch_ready(wait=True)
        self._wait_and_write_back(t0)

    def allreduce_gradients(self) -> None:
        """Average the gradients accumulated so far over the group, now.

        For callers that run backward passes under ``no_sync()`` and decide themselves when
        to synchronize, e.g. a pipeline step over several micro-batches (parallelize.py).
        Parameters without a gradient contribute zeros.
        """
        t0 = time.perf_counter()
        for b in self._buckets:
            self._launch(b, wait=True)
        self._wait_and_write_back(t0)

    def _wait_and_write_back(self, t0: float) -> None:
        """Wait for every bucket, then write the averages back; comm_wait_s: seconds from ``t0``
        (the end of backward's compute) until every bucket is reduced."""
        for b in self._buckets:
            if b.handle is not None:  # None: it ran on this thread (_launch with wait)
                b.handle.wait()
        self.comm_wait_s = time.perf_counter() - t0
        if self._carry is not None:
            self._carried, self._carry = self._buckets[-1].buffer[-self._carry_slots:].to(torch.float64, copy=True), None
        with torch.no_grad():
            dst, src = [], []
            for b in self._buckets:
                if b.wire is not b.buffer:
                    b.buffer.copy_(b.wire)
                for p, v in zip(b.params, b.views):
                    if self.gradient_as_bucket_view:
                        p.grad = v.view_as(p)  # the gradient lives in the bucket: no copy
                    elif p.grad is None:
                        p.grad = v.view_as(p).clone()
                    elif p.grad.data_ptr() != v.data_ptr():
                        dst.append(p.grad.view(-1) if p.grad.is_contiguous() else p.grad)
                        src.append(v if p.grad.is_contiguous() else v.view_as(p))
            if dst:
                torch._foreach_copy_(dst, src)  # one fused copy back for every bucket
