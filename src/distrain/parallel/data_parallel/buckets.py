"""Many tensors in one flat buffer: DDP's gradient buckets and the coalesced broadcast of its state.

One collective over a flat buffer instead of one per tensor (torch DDP's design, Li et al., VLDB 2020):

* :func:`plan_buckets`: the parameters in *reverse* registration order (roughly the order backward
  produces their gradients) cut into buckets of at most ``cap_bytes`` each, the first at most
  FIRST_BUCKET_BYTES (1 MiB: the last layers' gradients come first, so their all-reduce starts early
  and overlaps the rest of backward), a new bucket at every change of dtype;
* :class:`Bucket`: one bucket's parameters and the flat buffer reduced for them, with a view per parameter
  (:func:`views_of`);
* :func:`coalesced_batches`: tensors grouped per (dtype, device) into batches of at most
  BROADCAST_BATCH_BYTES, each broadcast as one flat copy (torch's ``_broadcast_coalesced``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from distrain.comm.core.util import nbytes

FIRST_BUCKET_BYTES = 1 << 20
BROADCAST_BATCH_BYTES = 64 << 20  # parameters/buffers packed per broadcast, at most (a copy of this size)


@dataclass
class Bucket:
    """One bucket of gradients: the parameters it holds and the flat buffer reduced for them."""

    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor  # flat, the dtype of the parameters
    views: list[torch.Tensor] = field(default_factory=list)  # buffer slices, one per param
    pending: int = 0
    handle: object | None = None
    wire: torch.Tensor | None = None  # what is all-reduced (buffer, or its compressed copy)
    index: int = 0  # position in launch order


def plan_buckets(named: list[tuple[str, nn.Parameter]], cap_bytes: float) -> list[list[tuple[str, nn.Parameter]]]:
    """``named`` (registration order) cut into buckets, in launch order (the module docstring)."""
    buckets, cur, size = [], [], 0
    for n, p in reversed(named):
        size_p = nbytes(p)
        cap = min(cap_bytes, FIRST_BUCKET_BYTES) if not buckets else cap_bytes
        if cur and (size + size_p > cap or p.dtype != cur[0][1].dtype):
            buckets.append(cur)
            cur, size = [], 0
        cur.append((n, p))
        size += size_p
    buckets.append(cur)
    return buckets


def views_of(buf: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The slices of the flat ``buf`` that hold ``params``, one after the other."""
    views, off = [], 0
    for p in params:
        views.append(buf[off:off + p.numel()])
        off += p.numel()
    return views


def coalesced_batches(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The non-empty ``tensors`` (their ``.data``) per (dtype, device), in batches of at most
    BROADCAST_BATCH_BYTES (a tensor larger than that alone in its batch)."""
    batches: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        if t.numel():
            b = batches.setdefault((t.dtype, t.device), [[]])
            if b[-1] and nbytes(t) + sum(nbytes(x) for x in b[-1]) > BROADCAST_BATCH_BYTES:
                b.append([])
            b[-1].append(t.data)
    return [g for bs in batches.values() for g in bs]
