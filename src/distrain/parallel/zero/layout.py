"""Flat shards: how the parameters of a ZeRO unit are laid out and split over P ranks.

A *unit* is a group of parameters that is communicated as one flat tensor: a gradient
bucket (stages 1 and 2) or one layer (stage 3). Its parameters are concatenated in order
into N elements; the flat tensor is padded with zeros to P * S elements, S = ceil(N / P),
so that every rank owns an equal shard [r*S, (r+1)*S) (all-gather and reduce-scatter need
equal pieces). Rank r holds ``real(r) = clamp(N - r*S, 0, S)`` real elements; the rest of
its shard is padding, which stays zero through AdamW and SGD (zero gradient, zero value,
and weight decay of zero is zero), so the padding never changes a result.

Traffic per rank and step (ring algorithm, e = bytes per element), the formulas of
Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models" (SC'20), section 7, written for padded units:

* stages 1 and 2: one reduce-scatter and one all-gather per unit: 2 (P-1) S e
  (DDP's ring all-reduce of the same N elements: 2 (P-1) N/P e, the same volume);
* stage 3: an all-gather before the unit's forward, another before its backward, and a
  reduce-scatter after it: 3 (P-1) S e, i.e. 1.5x DDP. A unit whose backward needs no
  parameter (an embedding's gradient needs only the indices) skips the second all-gather.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from distrain.errors import ConfigError


@dataclass(frozen=True)
class FlatUnit:
    """One unit's layout: parameter names, shapes, offsets in the flat tensor, and its shards."""

    index: int
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int  # N: real elements
    world: int  # P

    @property
    def shard(self) -> int:
        """S = ceil(N / P): elements per rank, padding included."""
        return -(-self.numel // self.world)

    @property
    def padded(self) -> int:
        return self.shard * self.world

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard, (rank + 1) * self.shard

    def real(self, rank: int) -> int:
        """Real (non-padding) elements in rank's shard."""
        return max(0, min(self.shard, self.numel - rank * self.shard))

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The parameters' shapes as views into a padded flat tensor of this unit."""
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def flatten(self, tensors: list[torch.Tensor | None], like: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """A padded flat tensor (P*S,) from one tensor per parameter (None -> zeros): a new one like
        ``like``, or ``out`` (P*S elements, e.g. in symmetric memory) overwritten."""
        fresh = out is None
        if fresh:
            out = torch.zeros(self.padded, dtype=like.dtype, device=like.device)
        else:
            out[self.numel:].zero_()  # the padding (the views cover [0, numel) without gaps)
        for v, t in zip(self.views(out), tensors):
            if t is not None:
                v.copy_(t)
            elif not fresh:
                v.zero_()
        return out

    def describe(self) -> dict:
        return {"names": list(self.names), "shapes": [list(s) for s in self.shapes], "numel": self.numel}


def make_unit(index: int, named: list[tuple[str, torch.Tensor]], world: int) -> FlatUnit:
    offsets, off = [], 0
    for _, p in named:
        offsets.append(off)
        off += p.numel()
    return FlatUnit(index, tuple(n for n, _ in named), tuple(p.shape for _, p in named), tuple(offsets), off, world)


def bucket_units(named: list[tuple[str, nn.Parameter]], world: int, cap_bytes: float) -> list[FlatUnit]:
    """Stages 1 and 2: buckets of at most cap_bytes, in reverse registration order.

    Reverse order is roughly the order in which backward produces gradients, so the first
    bucket's reduce-scatter can start while backward still runs (as in our DDP).
    """
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for n, p in reversed(named):
        nbytes = p.numel() * p.element_size()
        if groups[-1] and (size + nbytes > cap_bytes or p.dtype != groups[-1][0][1].dtype):
            groups.append([])
            size = 0
        groups[-1].append((n, p))
        size += nbytes
    return [make_unit(i, g, world) for i, g in enumerate(groups)]


def layer_modules(module: nn.Module, units: list[nn.Module] | None) -> list[nn.Module]:
    """Stage 3's units, in forward order: ``units`` if given, else ``module.layers`` (our GPT and
    MLP), else every submodule that owns parameters directly. Every parameter must fall in
    exactly one unit."""
    if units is None:
        layers = getattr(module, "layers", None)
        if isinstance(layers, nn.ModuleList):
            units = [m for m in layers if any(True for _ in m.parameters())]
        else:
            units = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    owner: dict[int, int] = {}
    for i, m in enumerate(units):
        for p in m.parameters():
            if id(p) in owner:
                raise ConfigError(f"ZeRO-3: a parameter of unit {i} ({type(m).__name__}) is also in unit {owner[id(p)]}; "
                                  f"units must not overlap and parameters must not be shared between them")
            owner[id(p)] = i
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in owner]
    if missing:
        raise ConfigError(f"ZeRO-3: parameter(s) {missing} are in no unit; pass units=[...] modules that cover "
                          f"every parameter (each unit is gathered around its own forward)")
    return list(units)
