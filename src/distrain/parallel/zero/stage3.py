"""ZeRO stage 3 (P_os+g+p): parameters sharded too, gathered one unit (layer) at a time.

At rest a rank holds, per unit, only its shard ``(S,)`` (an ``nn.Parameter``, what the
optimizer sees); the unit's module has plain attributes in place of its parameters.

* **Forward.** A forward pre-hook on the unit's module waits for the unit's all-gather
  (started by the previous unit's pre-hook: prefetch overlaps the all-gather of layer i+1
  with the compute of layer i), passes the gathered flat tensor ``(P*S,)`` through
  ``_Gather`` (identity in forward; in backward it receives the unit's full gradient), and
  installs views of it as the module's parameters. While the unit runs, saved-tensor hooks
  replace every tensor autograd saves that lives in that flat tensor (a weight, a
  transposed weight) by a reference (unit, offset, shape, stride), so nothing keeps the
  gathered parameters alive: the post-hook removes the views and they are freed.
* **Backward.** The first time autograd unpacks such a reference, the unit is all-gathered
  again (and the next unit backward that needs its parameters is prefetched); the
  reference becomes a view of the new tensor. When ``_Gather.backward`` receives the full
  gradient, the gathered parameters are dropped and the gradient is reduce-scattered
  asynchronously with op "avg"; a callback at the end of backward waits and
  accumulates each rank's piece into its shard's ``.grad``.

Contract: every rank runs the same units in the same order (the order of ``units``);
units do not nest or share parameters; a unit runs once per forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.zero.layout import FlatUnit, layer_modules, make_unit


class _ParamRef:
    """What the saved-tensor pack hook keeps instead of a gathered parameter."""

    __slots__ = ("unit", "offset", "shape", "stride")

    def __init__(self, unit: int, t: torch.Tensor):
        self.unit, self.offset, self.shape, self.stride = unit, t.storage_offset(), tuple(t.shape), t.stride()


class _Gather(torch.autograd.Function):
    """shard (S,) -> the unit's gathered flat parameters (P*S,); backward hands the gradient to the owner."""

    @staticmethod
    def forward(ctx, shard, owner, i):  # noqa: ARG004 (shard: only to connect the graph)
        ctx.owner, ctx.i = owner, i
        return owner._take(i)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.owner._grad_ready(ctx.i, grad_full)
        return None, None, None  # the shard's gradient is set by the end-of-backward callback


class Stage3:
    def __init__(self, module: nn.Module, group, rank: int, world: int, algorithm: str, src: int,
                 units: list[nn.Module] | None = None, prefetch: bool = True):
        self.module, self.group, self.rank, self.world = module, group, rank, world
        self.algorithm, self.prefetch = algorithm, prefetch
        frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
        if frozen:
            raise ConfigError(f"ZeRO-3: parameter(s) {frozen} have requires_grad=False; stage 3 shards every "
                              f"parameter; unfreeze them or use stage 1 or 2")
        mods = layer_modules(module, units)
        full_name = {id(p): n for n, p in module.named_parameters()}
        self.units: list[FlatUnit] = []
        self.slots: list[list[tuple[nn.Module, str]]] = []
        self.shards: list[nn.Parameter] = []
        with torch.no_grad():
            for i, m in enumerate(mods):
                named = list(m.named_parameters())
                u = make_unit(i, [(full_name[id(p)], p) for _, p in named], world)
                flat = u.flatten([p.detach() for _, p in named], named[0][1])
                comm.broadcast(flat, src=src, group=group, algorithm=algorithm)  # replicas start equal
                lo, hi = u.shard_range(rank)
                self.shards.append(nn.Parameter(flat[lo:hi].clone()))
                slots = []
                for rel, _ in named:
                    owner_name, _, attr = rel.rpartition(".")
                    owner = m.get_submodule(owner_name)
                    del owner._parameters[attr]  # the module no longer owns it: the shard does
                    setattr(owner, attr, None)
                    slots.append((owner, attr))
                self.units.append(u)
                self.slots.append(slots)
                m.register_forward_pre_hook(self._make_pre(i))
                m.register_forward_hook(self._make_post(i))
            for b in module.buffers():
                comm.broadcast(b, src=src, group=group, algorithm=algorithm)
        self._fetch: dict[int, tuple[object, torch.Tensor]] = {}  # unit -> (handle, flat) in flight
        self._bwd: dict[int, torch.Tensor] = {}  # unit -> gathered flat held for its backward
        self._needs_bwd = [False] * len(self.units)
        self._handles: list[tuple[int, object, torch.Tensor]] = []
        self._queued = False
        # grad_sink(i, flat gradient), when set, receives each unit's gathered gradient instead of the
        # reduce-scatter (distrain.parallel.invariant sums them in int64)
        self.grad_sink = None
        self._hooks = None
        self._raw: torch.Tensor | None = None

    # -- gathering ----------------------------------------------------------------------------
    def _start(self, i: int) -> None:
        if i in self._fetch or i in self._bwd:
            return
        u = self.units[i]
        flat = torch.empty(u.padded, dtype=self.shards[i].dtype)
        h = comm.all_gather(list(flat.view(self.world, u.shard)), self.shards[i].detach(), group=self.group,
                            async_op=True, algorithm=self.algorithm)
        self._fetch[i] = (h, flat)

    def _wait(self, i: int) -> torch.Tensor:
        self._start(i)
        h, flat = self._fetch.pop(i)
        h.wait()
        return flat

    def _take(self, i: int) -> torch.Tensor:
        flat, self._raw = self._raw, None
        return flat

    def gathered(self, i: int) -> torch.Tensor:
        """Unit i's padded flat parameters, all-gathered now (a collective: every rank calls it)."""
        return self._wait(i)

    # -- forward hooks --------------------------------------------------------------------------
    def _make_pre(self, i: int):
        def pre(mod, args):
            flat = self._wait(i)
            if self.prefetch and i + 1 < len(self.units):
                self._start(i + 1)
            self._needs_bwd[i] = False
            if torch.is_grad_enabled():
                self._raw = flat
                flat = _Gather.apply(self.shards[i], self, i)
                ptr = flat.untyped_storage().data_ptr()
                self._hooks = torch.autograd.graph.saved_tensors_hooks(self._make_pack(i, ptr), self._unpack)
                self._hooks.__enter__()
            for (owner, attr), v in zip(self.slots[i], self.units[i].views(flat)):
                setattr(owner, attr, v)
        return pre

    def _make_post(self, i: int):
        def post(mod, args, out):
            if self._hooks is not None:
                self._hooks.__exit__(None, None, None)
                self._hooks = None
            for owner, attr in self.slots[i]:
                setattr(owner, attr, None)  # drop the views: the gathered tensor is freed
        return post

    def _make_pack(self, i: int, ptr: int):
        def pack(t: torch.Tensor):
            if t.device.type != "meta" and t.untyped_storage().data_ptr() == ptr:
                self._needs_bwd[i] = True
                return _ParamRef(i, t)
            return t
        return pack

    def _unpack(self, x):
        if not isinstance(x, _ParamRef):
            return x
        self._enter_backward()
        flat = self._bwd.get(x.unit)
        if flat is None:
            flat = self._bwd[x.unit] = self._wait(x.unit)
            nxt = [j for j in range(x.unit - 1, -1, -1) if self._needs_bwd[j]]
            if self.prefetch and nxt:
                self._start(nxt[0])  # the next unit whose backward needs its parameters
        return flat.as_strided(x.shape, x.stride, x.offset)

    # -- backward ---------------------------------------------------------------------------------
    def _enter_backward(self) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def _grad_ready(self, i: int, grad_full: torch.Tensor) -> None:
        self._enter_backward()
        self._bwd.pop(i, None)  # unit i's backward is done: free its gathered parameters
        if self.grad_sink is not None:  # (layout-invariant training sums the gradients itself)
            self.grad_sink(i, grad_full.contiguous())
            return
        u = self.units[i]
        with torch.no_grad():
            g = grad_full.contiguous()
            out = torch.empty(u.shard, dtype=g.dtype)
            # "avg": the sum divided by P once, on the shard only (no full-size divided copy)
            h = comm.reduce_scatter(out, list(g.view(self.world, u.shard)), op="avg", group=self.group,
                                    async_op=True, algorithm=self.algorithm)
        self._handles.append((i, h, out))

    def finish_backward(self) -> None:
        for i, h, out in self._handles:
            h.wait()
            s = self.shards[i]
            s.grad = out if s.grad is None else s.grad.add_(out)
        for i in list(self._fetch):  # a prefetch nobody used (not expected): complete it, drop it
            self._wait(i)
        self._bwd.clear()
        self._handles = []
        self._queued = False

    # -- engine interface -------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def after_step(self) -> None:
        """Nothing to do: the optimizer updated the shards, which are the parameters."""

    def full_flat(self, i: int) -> torch.Tensor:
        return self.gathered(i)

    def zero_grad(self) -> None:
        pass

    def resident(self) -> dict[str, list[torch.Tensor]]:
        return {"params": list(self.shards) + list(self._bwd.values()),
                "grads": [s.grad for s in self.shards if s.grad is not None]}
