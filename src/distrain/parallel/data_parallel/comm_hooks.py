"""DDP communication hooks: what reduces a bucket instead of the built-in all-reduce.

torch DDP's ``register_comm_hook(state, hook)`` contract, which our DDP follows
(``DistributedDataParallel.register_comm_hook``):

* ``hook(state, bucket) -> torch.futures.Future[Tensor]`` is called once per bucket, in bucket
  order, as soon as the bucket's gradients are ready (during backward). ``state`` is whatever
  was registered with the hook.
* ``bucket.buffer()`` is the bucket's flat gradient, the *plain* local gradients (the hook
  does the averaging, not DDP). The future's value is the bucket's reduced gradient (the
  average over the group), a flat tensor of the same length; DDP waits for it at the end of
  backward and writes it to ``.grad``.
* One hook per model, registered before the first backward pass.

:class:`GradBucket` gives a hook torch's ``GradBucket`` methods (``buffer``, ``set_buffer``,
``gradients``, ``parameters``, ``index``, ``is_last``), so torch's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks``) run on our DDP when its group is a torch
process group: they call ``torch.distributed`` directly, i.e. Gloo/NCCL.

Ours, below, are the standard hooks written on :mod:`distrain.comm`, so they all-reduce with
the model's own ``algorithm=`` (native, star, ring, tree) and transport. Each one computes
exactly what torch's hook of the same name computes, operation for operation (the same
division before the sum, the same casts, the same PowerSGD arithmetic and random Q), so with
the same summation order (P=2, or ``algorithm="native"`` with torch's bucket layout) the bits
are the same: ``tests/test_ddp_hooks.py``.

    allreduce_hook       divide by P, sum: the plain average, in the bucket's dtype
    fp16_compress_hook   cast to float16, divide by P, sum, cast back (half the bytes)
    bf16_compress_hook   the same in bfloat16
    PowerSGDState, powersgd_hook   rank-r PowerSGD (Vogels et al. 2019), in powersgd.py

``state`` of the first three is a process group or None; for all four, None means the DDP's
own group (torch's hooks take None as the world group, the same unless DDP runs on a subgroup).
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import ConfigError

__all__ = ["GradBucket", "allreduce_hook", "fp16_compress_hook", "bf16_compress_hook", "PowerSGDState",
           "powersgd_hook", "powerSGD_hook"]


class GradBucket:
    """One bucket as a hook sees it: torch's ``torch.distributed.GradBucket`` methods, plus the
    DDP's ``group`` and ``algorithm`` (which distrain's hooks use)."""

    def __init__(self, index: int, num_buckets: int, buffer: torch.Tensor, params: list, group, algorithm: str):
        self._index, self._last = index, index == num_buckets - 1
        self._buffer = buffer
        self._params = list(params)
        self.group, self.algorithm = group, algorithm

    def index(self) -> int:
        """The bucket's position in launch order (0 holds the last layers, whose gradients come first)."""
        return self._index

    def is_last(self) -> bool:
        """Whether this is the last bucket of the backward pass (hooks count iterations on it)."""
        return self._last

    def buffer(self) -> torch.Tensor:
        """The flat gradient of the bucket's parameters, in bucket order."""
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (e.g. by a compressed copy); :meth:`gradients` then views the new one."""
        self._buffer = buffer

    def parameters(self) -> list[torch.Tensor]:
        """The bucket's parameters, in the order of their gradients in the buffer."""
        return list(self._params)

    def gradients(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter, shaped like the parameter."""
        out, off = [], 0
        for p in self._params:
            out.append(self._buffer[off:off + p.numel()].view(p.shape))
            off += p.numel()
        return out


# ---------------------------------------------------------------------------------------
# How our DDP runs a hook (ddp.py calls these)
# ---------------------------------------------------------------------------------------

def check_registration(hook, registered, backward_seen: bool, wire_dtype) -> None:
    """torch's rules for ``register_comm_hook`` (``registered``: the model's hook or None; ``wire_dtype``:
    its compression or None), with the fix in each message."""
    where = "DistributedDataParallel.register_comm_hook"
    if registered is not None:
        raise ConfigError(f"{where}: a communication hook ({_name(registered)}) is already registered and a model "
                          f"takes only one; register a single hook, once, right after wrapping the model")
    if backward_seen:
        raise ConfigError(f"{where}: called after a backward pass; register the hook before the first backward "
                          f"(right after wrapping the model), as torch DDP requires")
    if not callable(hook) or not _takes_two_arguments(hook):
        raise ConfigError(f"{where}: hook must be a callable hook(state, bucket) -> torch.futures.Future, "
                          f"got {hook!r}")
    if wire_dtype is not None:
        raise ConfigError(f"{where}: compression= and a hook both decide what is all-reduced; drop compression= "
                          f"and register fp16_compress_hook or bf16_compress_hook (comm_hooks.py) instead")


def run_hook(hook, state, bucket: GradBucket) -> HookHandle:
    """Call ``hook(state, bucket)``, a model's registered hook, on one bucket."""
    buffer = bucket.buffer()  # the bucket's own (a hook may set_buffer a compressed copy)
    fut = hook(state, bucket)
    if not isinstance(fut, torch._C.Future):  # torch.futures.Future, or a Work's future
        raise ConfigError(f"DistributedDataParallel: the communication hook {_name(hook)} returned "
                          f"{type(fut).__name__}; a hook returns a torch.futures.Future whose value is the "
                          f"bucket's reduced flat gradient")
    return HookHandle(fut, buffer, bucket.index())


class HookHandle:
    """A bucket's hook future as DDP waits on it (like an all-reduce's handle): ``wait()``
    leaves the future's value, the reduced bucket, in the bucket's buffer."""

    def __init__(self, future: torch.futures.Future, buffer: torch.Tensor, index: int):
        self.future, self.buffer, self.index = future, buffer, index

    def wait(self) -> None:
        result = self.future.wait()
        if not isinstance(result, torch.Tensor) or result.numel() != self.buffer.numel():
            what = f"{result.numel()} elements" if isinstance(result, torch.Tensor) else type(result).__name__
            raise ConfigError(f"DistributedDataParallel: the communication hook's future for bucket {self.index} "
                              f"holds {what}; it must hold the bucket's reduced flat gradient "
                              f"({self.buffer.numel()} elements)")
        if result.data_ptr() != self.buffer.data_ptr() or result.dtype != self.buffer.dtype:
            self.buffer.copy_(result.reshape(self.buffer.shape))


def _name(hook) -> str:
    return getattr(hook, "__qualname__", None) or repr(hook)


def _takes_two_arguments(hook) -> bool:
    try:
        inspect.signature(hook).bind(None, None)
        return True
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): let the call decide
        return True


# ---------------------------------------------------------------------------------------
# Our hooks
# ---------------------------------------------------------------------------------------

def hook_group(state_group, bucket: GradBucket):
    """The group a hook reduces over: its state's (torch's process_group), else the DDP's."""
    return state_group if state_group is not None else bucket.group


def all_reduce_future(tensor: torch.Tensor, group, algorithm: str) -> torch.futures.Future:
    """Sum ``tensor`` over the group in place, asynchronously; the future's value is ``tensor``."""
    handle = comm.all_reduce(tensor, op="sum", group=group, async_op=True, algorithm=algorithm)
    return handle.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over the group: divide by P, then sum (in place, in the bucket's dtype).

    torch's ``default_hooks.allreduce_hook``: dividing first keeps a half-precision sum from
    overflowing. The same average DDP takes without a hook, except in the last bit where x / P
    and x * (1/P) differ (the hook-less path multiplies while copying, as torch's reducer).
    ``process_group``: the group (None: the DDP's group).
    """
    group = hook_group(process_group, bucket)
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size(group))
    return all_reduce_future(buffer, group, bucket.algorithm)


def _compress_hook(dtype: torch.dtype, process_group, bucket: GradBucket) -> torch.futures.Future:
    group = hook_group(process_group, bucket)
    buffer = bucket.buffer()
    wire = buffer.to(dtype).div_(dist.get_world_size(group))  # cast, then divide in the wire dtype (as torch)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])  # back into the bucket's own dtype, in place
        return buffer

    handle = comm.all_reduce(wire, op="sum", group=group, async_op=True, algorithm=bucket.algorithm)
    return handle.get_future().then(decompress)


def fp16_compress_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """All-reduce the bucket in float16 (half the bytes of float32): cast the gradient to
    float16, divide it by P, sum, and cast the average back into the bucket. As torch's
    ``default_hooks.fp16_compress_hook``; ``process_group`` as in :func:`allreduce_hook`."""
    return _compress_hook(torch.float16, process_group, bucket)


def bf16_compress_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """:func:`fp16_compress_hook` in bfloat16 (float32's range, 8 bits of mantissa). As torch's
    ``default_hooks.bf16_compress_hook``."""
    return _compress_hook(torch.bfloat16, process_group, bucket)
