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

Before each forward the buffers (BatchNorm running statistics) are broadcast from the
group's first rank, as torch DDP does (``broadcast_buffers`` / ``forward_sync_buffers``), so
every replica normalizes evaluation batches alike. ``gradient_as_bucket_view=True`` leaves
``.grad`` as views into the buckets (no copy back, one buffer less).

On the shared-memory transport (``algorithm="native"``, every rank on this host, no
compression) step 3 skips the flat buffer: the bucket's gradients themselves are
all-reduced in place (``comm.all_reduce_list``), scaled by 1/P on their way into the slots,
so the copy into the bucket and the copy back to ``.grad`` are gone; the bits are the same.

``no_sync()`` skips 3-4 (gradients accumulate locally; the next synchronized backward
all-reduces the sum). A parameter that got no gradient raises an error naming it, unless
``find_unused_parameters=True``, which all-reduces zeros for it instead. ``compression=
"bf16"|"fp16"`` all-reduces the buckets in that dtype (half the bytes, lower precision).
``register_comm_hook(state, hook)``: a hook reduces each bucket instead (comm_hooks.py: torch's
contract; allreduce, fp16, bf16, PowerSGD); ``join()``: uneven numbers of batches (join.py).

Contract: every rank wraps the same model (same parameter shapes and order) and runs the
same number of synchronized backward passes.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_map

from distrain import comm
from distrain.comm.core.util import nbytes
from distrain.errors import CommError, ConfigError
from distrain.parallel.data_parallel import comm_hooks
from distrain.parallel.data_parallel.join import Join

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
    in_place: bool = False  # the gradients themselves were all-reduced (no copy into buffer and back)
    index: int = 0  # position in launch order


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over the group.

    Takes torch DDP's constructor arguments, in torch's order and with torch's meaning (see
    :func:`_torch_options`), plus distrain's own keyword-only ones: ``algorithm`` (native,
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
        _unsupported(delay_all_reduce_named_params=delay_all_reduce_named_params,
                     param_to_hook_all_reduce=param_to_hook_all_reduce, mixed_precision=mixed_precision,
                     device_mesh=device_mesh, skip_all_reduce_unused_params=skip_all_reduce_unused_params,
                     bucket_cap_mb_list=bucket_cap_mb_list)
        opts = _torch_options(module, device_ids, output_device, dim, broadcast_buffers, forward_sync_buffers,
                              check_reduction, process_group, group)
        self.module = module
        self.group = opts.group
        self.device_ids, self.output_device, self.dim = opts.device_ids, opts.output_device, dim
        self._input_device = opts.input_device
        self.algorithm = algorithm
        self.find_unused_parameters = find_unused_parameters
        self.static_graph = static_graph  # the same parameters unused every step: no error for them
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.batched_grad_copy = batched_grad_copy
        self.forward_sync_buffers = opts.forward_sync_buffers
        self.wire_dtype = _COMPRESSION[compression]
        self.world = dist.get_world_size(self.group)
        self.src = dist.get_process_group_ranks(self.group or dist.group.WORLD)[0]
        self.comm_wait_s = 0.0  # time the last backward spent blocked on communication
        self._sync = True
        self._step_sync = True
        self._queued = False
        self._require_forward_buffer_sync = True  # torch's require_forward_param_sync
        self._hook, self._hook_state, self._join, self._backward_seen = None, None, None, False  # comm hook, join()
        self._div = self.world  # gradients are averaged over this many ranks (join() may lower it)

        if init_sync:
            self._broadcast_state(buffers=opts.init_sync_buffers)
        self._buckets = self._build_buckets(bucket_cap_mb * 2 ** 20)
        self._bucket_of: dict[int, int] = {}
        for b, bucket in enumerate(self._buckets):
            for p in bucket.params:
                self._bucket_of[id(p)] = b
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._ready: set[int] = set()
        self._next_launch = 0
        # the gradients straight through the shared-memory slots (the module docstring)
        self._in_place = (self.wire_dtype is None and not gradient_as_bucket_view
                          and comm.has_list_all_reduce(self.group, algorithm))

    @property
    def broadcast_buffers(self) -> bool:
        """torch's name for :attr:`forward_sync_buffers`."""
        return self.forward_sync_buffers

    # -- set-up ------------------------------------------------------------------------------
    def _broadcast_state(self, params: bool = True, buffers: bool = True, src: int | None = None) -> None:
        """Parameters and/or buffers (BatchNorm running stats, ...) from global rank ``src``
        (default: the group's first) to every rank."""
        tensors = (list(self.module.parameters()) if params else []) + (list(self.module.buffers()) if buffers else [])
        with torch.no_grad():
            for t in tensors:
                comm.broadcast(t.data, src=self.src if src is None else src, group=self.group, algorithm=self.algorithm)

    def _build_buckets(self, cap_bytes: float) -> list[_Bucket]:
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        if not named:
            raise ConfigError("DistributedDataParallel: the module has no parameter that requires grad")
        buckets, cur, size = [], [], 0
        for n, p in reversed(named):
            size_p = nbytes(p)
            # The first bucket (the last layers, whose gradients come first) is capped at
            # 1 MiB, as in torch DDP: its all-reduce starts early and overlaps the rest.
            cap = min(cap_bytes, FIRST_BUCKET_BYTES) if not buckets else cap_bytes
            if cur and (size + size_p > cap or p.dtype != cur[0][1].dtype):
                buckets.append(cur)
                cur, size = [], 0
            cur.append((n, p))
            size += size_p
        buckets.append(cur)
        out = []
        for group in buckets:
            params = [p for _, p in group]
            buf = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            views, off = [], 0
            for p in params:
                views.append(buf[off:off + p.numel()])
                off += p.numel()
            out.append(_Bucket(params=params, names=[n for n, _ in group], buffer=buf, views=views, index=len(out)))
        return out

    @property
    def bucket_sizes(self) -> list[int]:
        """Bytes per bucket, in launch order (the first bucket holds the last layers)."""
        return [nbytes(b.buffer) for b in self._buckets]

    # -- forward / backward ------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # As torch DDP: buffers come from the first rank before the forward, unless the previous
        # forward ran under no_sync() or without grad (torch's require_forward_param_sync).
        sync_buffers = self.forward_sync_buffers and self._require_forward_buffer_sync
        src = self._join.notify(self._sync and torch.is_grad_enabled(), sync_buffers) if self._join else self.src
        if sync_buffers:
            self._broadcast_state(params=False, src=src)
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
        self._require_forward_buffer_sync = torch.is_grad_enabled() and self._sync
        return out

    def register_comm_hook(self, state, hook) -> None:
        """torch DDP's: ``hook(state, bucket) -> Future[Tensor]`` reduces each bucket (comm_hooks.py)."""
        comm_hooks.check_registration(self, hook)
        self._hook, self._hook_state, self._in_place = hook, state, False

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch DDP's: a rank out of data answers the others' all-reduces with zeros (join.py)."""
        return Join(self, divide_by_initial_world_size, enable, throw_on_early_termination)

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

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].pending == 0:
            self._launch(self._buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        grads = [p.grad for p in b.params]
        b.in_place = self._in_place and all(g is not None and g.is_contiguous() and g.dtype == b.buffer.dtype
                                            for g in grads)
        if b.in_place:  # no bucket copy: the gradients go to the slots, scaled by 1/P on the way in
            b.handle = comm.all_reduce_list(grads, scale=1.0 / self._div, group=self.group, async_op=True)
            return
        # Pre-divide, then sum: the average without a final pass, and no fp16 overflow. As in
        # torch's reducer, a gradient that is not yet the bucket's view is multiplied by 1/P
        # while it is copied in (one pass over it, not two: the same bits as torch DDP's
        # at every P); one that already is the view (gradient_as_bucket_view) is divided. A comm
        # hook gets the plain gradients (it averages them itself): then the factor is 1.
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
            if self.batched_grad_copy and dst:
                torch._foreach_copy_(dst, src)  # fused per bucket: a copy, then the scale
                torch._foreach_mul_(dst, 1.0 / div)
            else:
                inv = 1.0 / div
                for v, g in zip(dst, src):
                    torch.mul(g, inv, out=v)
            b.wire = b.buffer if self.wire_dtype is None else b.buffer.to(self.wire_dtype)  # (None with a hook)
            b.handle = comm_hooks.run_hook(self, b.index, b.buffer) if self._hook is not None else \
                comm.all_reduce(b.wire, op="sum", group=self.group, async_op=True, algorithm=self.algorithm)

    def _finish_backward(self) -> None:
        missing = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in self._ready]
        if missing and not (self.find_unused_parameters or self.static_graph):
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
                if b.in_place:
                    continue  # the averaged gradients are already in .grad
                if b.wire is not b.buffer:
                    b.buffer.copy_(b.wire)
                for p, v in zip(b.params, b.views):
                    if self.gradient_as_bucket_view:
                        p.grad = v.view_as(p)  # the gradient lives in the bucket: no copy
                    elif p.grad is None:
                        p.grad = v.view_as(p).clone()
                    else:
                        p.grad.copy_(v.view_as(p))


# ---------------------------------------------------------------------------------------
# torch DDP's constructor arguments
# ---------------------------------------------------------------------------------------

@dataclass
class _Options:
    group: object
    device_ids: list[int] | None
    output_device: int | None
    input_device: torch.device | None
    forward_sync_buffers: bool
    init_sync_buffers: bool


_NOT_SUPPORTED = {  # argument: (its default, what to do instead)
    "delay_all_reduce_named_params": (None, "every parameter is all-reduced in its bucket"),
    "param_to_hook_all_reduce": (None, "every parameter is all-reduced in its bucket"),
    "mixed_precision": (None, "use compression='bf16' or 'fp16' to all-reduce in half precision"),
    "device_mesh": (None, "pass process_group= (e.g. topo.dp_group)"),
    "skip_all_reduce_unused_params": (False, "unused parameters are all-reduced as zeros"),
    "bucket_cap_mb_list": (None, "use bucket_cap_mb (the first bucket is capped at 1 MiB, as in torch)"),
}


def _unsupported(**given) -> None:
    for name, value in given.items():
        default, instead = _NOT_SUPPORTED[name]
        if value is not default and value != default:
            raise ConfigError(f"DistributedDataParallel: {name}={value!r} is not supported by distrain's DDP; "
                              f"leave it at {default!r} ({instead})")


def _torch_options(module, device_ids, output_device, dim, broadcast_buffers, forward_sync_buffers,
                   check_reduction, process_group, group) -> _Options:
    """torch DDP's rules for the arguments that change nothing in the gradient math:

    * ``process_group`` (or distrain's ``group``): the group; None is the world.
    * ``device_ids`` / ``output_device``: None for CPU modules (an error otherwise, as in torch);
      a one-element list for a single-device accelerator module, whose inputs are moved there.
    * ``broadcast_buffers`` / ``forward_sync_buffers`` (torch 2.13): buffers broadcast from the
      group's first rank before each forward (default True); ``broadcast_buffers=False`` also
      leaves buffers out of the initial broadcast, ``forward_sync_buffers=False`` does not.
    * ``dim``: the scatter dimension of multi-device modules (unused for one device, as in torch);
      ``check_reduction``: deprecated in torch, no effect (a FutureWarning, as in torch).
    """
    if process_group is not None and group is not None and process_group is not group:
        raise ConfigError("DistributedDataParallel: pass the group once, as process_group= or group=, not both")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise ConfigError(f"DistributedDataParallel: dim must be an int, got {dim!r}")
    if device_ids is not None and len(device_ids) > 1:
        raise ConfigError(f"DistributedDataParallel: device_ids can only be None or contain a single element, "
                          f"got {device_ids}")
    devices = {p.device for p in module.parameters()}
    if (device_ids or output_device is not None) and (len(devices) != 1 or next(iter(devices)).type == "cpu"):
        raise ConfigError(f"DistributedDataParallel: device_ids and output_device only apply to a module on one "
                          f"accelerator; this module's parameters are on {sorted(map(str, devices))}: pass "
                          f"device_ids=None, output_device=None (got {device_ids}, {output_device})")
    ids = [torch.device(d).index if not isinstance(d, int) else d for d in device_ids] if device_ids else None
    out = output_device if output_device is not None else (ids[0] if ids else None)
    if check_reduction:
        warnings.warn("DistributedDataParallel: check_reduction is deprecated (as in torch) and has no effect",
                      FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        if broadcast_buffers is not None:
            warnings.warn("DistributedDataParallel: broadcast_buffers is ignored when forward_sync_buffers is "
                          "given (as in torch)", FutureWarning, stacklevel=3)
        fwd, init = bool(forward_sync_buffers), True
    else:
        fwd = init = True if broadcast_buffers is None else bool(broadcast_buffers)
    dev = torch.device(next(iter(devices)).type, ids[0]) if ids else None
    return _Options(process_group if process_group is not None else group, ids, out, dev, fwd, init)
