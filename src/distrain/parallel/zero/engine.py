"""``Zero``: the public ZeRO engine (stages 1, 2, 3) around a module and its optimizer.

    engine = Zero(model, lambda params: torch.optim.AdamW(params, lr=1e-3), stage=3, algorithm="ring")
    loss = loss_fn(engine(x), y)
    loss.backward()                 # gradients reduce-scattered during backward
    engine.clip_grad_norm_(1.0)     # global norm over every rank's shard
    engine.step()                   # optimizer on this rank's shards (+ all-gather, stages 1-2)
    engine.zero_grad()

The optimizer is built by the caller's factory over this rank's flat shards
(``engine.parameters()``), so any elementwise optimizer works unchanged and its state covers
1/P of the model (AdamW and SGD with momentum are tested; an optimizer that needs whole
tensors, e.g. one with per-matrix norms, would not be exact). Gradients are averaged over
the group, as with DDP. Checkpoints: ``state_dict()`` is this rank's shards and optimizer
state, loadable only into the same layout; ``full_state_dict()`` (a collective) is the
consolidated model and per-parameter optimizer state under the original parameter names,
loadable by ``load_full_state_dict`` into any stage and world size (or, its ``"model"``
part, into a plain module).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.clip import clip_grad_norm
from distrain.parallel.zero.stage12 import Stage12
from distrain.parallel.zero.stage3 import Stage3

STAGES = (1, 2, 3)
FORMAT = "distrain.zero/1"


class _OwnGroup:
    """The default ``group`` of :meth:`Zero.clip_grad_norm_`: the engine's own (None already means the world)."""

    def __repr__(self) -> str:
        return "<this engine's group>"


_OWN_GROUP = _OwnGroup()


class Zero:
    """ZeRO data parallelism over ``group`` (None = world) on distrain.comm's ``algorithm``."""

    def __init__(self, module: nn.Module, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 stage: int = 3, group=None, algorithm: str = "ring", bucket_cap_mb: float = 25.0,
                 units: list[nn.Module] | None = None, prefetch: bool = True):
        if stage not in STAGES:
            raise ConfigError(f"Zero: stage must be 1, 2 or 3, got {stage!r}")
        if algorithm not in comm.ALGORITHM_NAMES:
            raise ConfigError(f"Zero: unknown algorithm {algorithm!r}; use one of {', '.join(comm.ALGORITHM_NAMES)}")
        if not bucket_cap_mb > 0:
            raise ConfigError(f"Zero: bucket_cap_mb must be positive, got {bucket_cap_mb}")
        if not callable(optimizer):
            raise ConfigError("Zero: optimizer must be a factory, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)")
        if units is not None and stage != 3:
            raise ConfigError(f"Zero: units= applies to stage 3 only (stage {stage} buckets by bucket_cap_mb)")
        if not any(p.requires_grad for p in module.parameters()):
            raise ConfigError("Zero: the module has no parameter that requires grad")
        self.module, self.stage, self.group, self.algorithm = module, stage, group, algorithm
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        src = dist.get_process_group_ranks(group or dist.group.WORLD)[0]
        if stage == 3:
            self.impl = Stage3(module, group, self.rank, self.world, algorithm, src, units, prefetch)
        else:
            self.impl = Stage12(module, stage, group, self.rank, self.world, algorithm, bucket_cap_mb * 2 ** 20, src)
        self.optimizer = optimizer(list(self.impl.shards))
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise ConfigError(f"Zero: the optimizer factory returned {type(self.optimizer).__name__}, "
                              f"not a torch.optim.Optimizer")
        given = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        if given != {id(s) for s in self.impl.shards}:
            raise ConfigError("Zero: the optimizer factory must optimize exactly the parameters it is given "
                              "(this rank's shards)")

    @property
    def units(self):
        return self.impl.units

    def parameters(self) -> list[nn.Parameter]:
        """This rank's flat shards, one per unit (what the optimizer updates)."""
        return list(self.impl.shards)

    def __call__(self, *args, **kwargs):
        return self.impl.forward(*args, **kwargs)

    @property
    def training(self) -> bool:
        return self.module.training

    def train(self, mode: bool = True) -> "Zero":
        self.module.train(mode)
        return self

    def eval(self) -> "Zero":
        return self.train(False)

    # -- the step -------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.impl.zero_grad()

    @contextlib.contextmanager
    def no_sync(self):
        """Stages 1-2: backward passes inside only accumulate the full-size gradients (no
        communication); ``reduce_gradients()`` afterwards reduce-scatters them once (e.g. after
        a pipeline's micro-batches). Stage 3 holds no full-size gradient to accumulate into."""
        if self.stage == 3:
            raise ConfigError("Zero.no_sync: stage 3 reduce-scatters each unit's gradient as backward produces it "
                              "(it keeps no full-size gradient); use stage 1 or 2")
        self.impl.sync = False
        try:
            yield
        finally:
            self.impl.sync = True

    def reduce_gradients(self) -> None:
        """After backward passes under ``no_sync()``: reduce-scatter every bucket into the shards' grads."""
        if self.stage == 3:
            raise ConfigError("Zero.reduce_gradients: stage 3 reduces during backward; there is nothing to reduce")
        self.impl.finish_backward()

    def _count_masks(self, count: Callable[[str], bool]) -> list[torch.Tensor | None]:
        """Per unit, this rank's shard of a 0/1 mask of the elements whose parameter ``count``s
        (None where all do); cached, as ``count`` is fixed for a run."""
        if getattr(self, "_masks", None) is None:
            masks = []
            for u, s in zip(self.units, self.impl.shards):
                keep = [count(n) for n in u.names]
                if all(keep):
                    masks.append(None)
                    continue
                like = torch.empty(0, dtype=torch.float64, device=s.device)
                flat = u.flatten([torch.full(sh, float(k), dtype=torch.float64) for k, sh in zip(keep, u.shapes)], like)
                lo, hi = u.shard_range(self.rank)
                masks.append(flat[lo:hi].clone())
            self._masks = masks
        return self._masks

    def clip_grad_norm_(self, max_norm: float, count: Callable[[str], bool] | None = None,
                        group=_OWN_GROUP) -> float:
        """Scale every shard's gradient so that the global L2 norm is at most max_norm; return the norm.

        Each rank sums the squares of its shard (padding is zero), one all-reduce over ``group`` adds
        them; the scale is min(1, max_norm / (norm + 1e-6)), as in torch.nn.utils.clip_grad_norm_.
        ``group``: the ranks whose shards make up the model, the group that all-reduce runs over; left
        out, this engine's group (its ranks' shards are the whole module). Inside a dp x tp x pp mesh
        the norm covers the whole model: pass the group of every rank of the mesh (each tp and pp
        shard, each dp shard): None for the world (as distrain.comm reads None), a DiLoCo island's
        group for an island's grid; and ``count(name)`` False for the parameters this rank holds a copy
        of that another rank counts (a tp-replicated LayerNorm counted on tp rank 0 only).
        """
        if not max_norm > 0:
            raise ConfigError(f"Zero.clip_grad_norm_: max_norm must be positive, got {max_norm}")
        masks = self._count_masks(count) if count is not None else [None] * len(self.units)
        terms = [(s.grad, 1 if m is None else m) for s, m in zip(self.impl.shards, masks)]
        return clip_grad_norm(terms, max_norm, reduce=True, group=self.group if group is _OWN_GROUP else group,
                              algorithm=self.algorithm)

    def step(self) -> None:
        self.optimizer.step()
        self.impl.after_step()

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now: parameters, gradients, optimizer state (distinct storages)."""
        from distrain.parallel.zero.memory import optimizer_state_tensors, resident_bytes

        r = self.impl.resident()
        return {"params": resident_bytes(r["params"]), "grads": resident_bytes(r["grads"]),
                "optimizer": resident_bytes(optimizer_state_tensors(self.optimizer))}

    # -- checkpoints ------------------------------------------------------------------------------
    def _layout(self) -> dict:
        return {"stage": self.stage, "world": self.world, "units": [u.describe() for u in self.units]}

    def state_dict(self, copy: bool = True) -> dict:
        """This rank's shards and optimizer state (load into the same stage, world size and units).
        ``copy=False``: the live shards themselves (a caller that copies them at once, e.g. an elastic
        job's per-step piece); the optimizer's state is its live tensors either way."""
        return {"format": FORMAT, "rank": self.rank, "layout": self._layout(),
                "shards": [s.detach().clone() if copy else s.detach() for s in self.impl.shards],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("format") != FORMAT:
            raise ConfigError(f"Zero.load_state_dict: not a sharded ZeRO checkpoint (format {FORMAT!r})")
        if sd["layout"] != self._layout() or sd["rank"] != self.rank:
            raise ConfigError(
                f"Zero.load_state_dict: the checkpoint of rank {sd['rank']} was saved with stage "
                f"{sd['layout']['stage']} on {sd['layout']['world']} ranks, this is rank {self.rank} of stage "
                f"{self.stage} on {self.world} ranks (or the units differ); save with full_state_dict() and "
                f"load with load_full_state_dict() to change the layout")
        with torch.no_grad():
            for s, t in zip(self.impl.shards, sd["shards"]):
                s.copy_(t)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.impl.after_step()

    def full_state_dict(self) -> dict:
        """Consolidated model and optimizer state by parameter name (a collective; every rank gets it)."""
        from distrain.parallel.zero.consolidate import full_state

        return full_state(self)

    def load_full_state_dict(self, full: dict) -> None:
        """Load a consolidated checkpoint saved from any stage and world size (every rank calls it)."""
        from distrain.parallel.zero.consolidate import load_full_state

        load_full_state(self, full)
