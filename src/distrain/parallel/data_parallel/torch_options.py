"""torch DDP's constructor arguments that change nothing in the gradient math, checked and
mapped the way torch does (:func:`torch_options`), and the ones distrain's DDP does not take
(:func:`unsupported`, each with what to do instead)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from distrain.errors import ConfigError


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


def unsupported(**given) -> None:
    for name, value in given.items():
        default, instead = _NOT_SUPPORTED[name]
        if value is not default and value != default:
            raise ConfigError(f"DistributedDataParallel: {name}={value!r} is not supported by distrain's DDP; "
                              f"leave it at {default!r} ({instead})")


def torch_options(module, device_ids, output_device, dim, broadcast_buffers, forward_sync_buffers,
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
