"""ZeRO stages 1 and 2: full parameters on every rank, optimizer state (and gradients) sharded.

Every rank keeps the whole model. Its parameters are views into one padded flat tensor per
bucket (layout.py), and the rank's shard of that flat tensor is the ``nn.Parameter`` its
optimizer sees, so the optimizer's state covers 1/P of the model (stage 1, P_os in the
paper). During backward, as soon as every gradient of a bucket is there (post-accumulate-
grad hooks, buckets launched in index order so all ranks issue the same collectives), the
bucket's gradients, pre-divided by P, are reduce-scattered asynchronously: each rank gets
the averaged gradient of its shard only (accumulated in the shard's ``.grad``, so several
backward passes per step accumulate). Stage 2 (P_os+g) then drops the full gradients
(``p.grad = None``), so a rank holds gradients for its shard only; stage 1 keeps its
full-size gradient tensors (zeroed, e Psi bytes, as the paper's P_os) beside the shard's.
After the optimizer updated the shards, ``after_step`` all-gathers every bucket's flat
tensor, which writes the new values straight into the parameters (they are views of it).

On the shared-memory transport (native algorithm, CPU) both exchanges work on symmetric
memory (``comm.symmetric_empty``: every peer maps the buffer): the parameters' flat tensors
live there, so the all-gather copies each shard straight from its owner's flat tensor, and the
gradients are flattened into a fixed pool of two bucket-sized symmetric buffers, so the
reduce-scatter folds each rank's part straight from the P owners' buffers (no slots either
way). A pool buffer is reused two buckets later, after that bucket's reduce-scatter is done.

Shapes: unit u has N_u real elements, S_u = ceil(N_u / P); flat (P*S_u,), shard (S_u,).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from distrain import comm
from distrain.parallel.zero.layout import FlatUnit, bucket_units


class Stage12:
    def __init__(self, module: nn.Module, stage: int, group, rank: int, world: int, algorithm: str,
                 bucket_cap_bytes: float, src: int):
        self.module, self.stage, self.group = module, stage, group
        self.rank, self.world, self.algorithm = rank, world, algorithm
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.units: list[FlatUnit] = bucket_units(named, world, bucket_cap_bytes)
        by_name = dict(named)
        self.params = [[by_name[n] for n in u.names] for u in self.units]
        self.flats: list[torch.Tensor] = []
        self.shards: list[nn.Parameter] = []
        like = named[0][1] if named else None
        self.symmetric = like is not None and like.device.type == "cpu" and algorithm == "native" and \
            world > 1 and comm.transport_of(group) == "shm"
        # the gradient pool: two byte buffers of the largest unit, used in turn (see the module doc); a unit
        # views its front in its own dtype (units are split by dtype)
        nbytes = [u.padded * ps[0].element_size() for u, ps in zip(self.units, self.params)]
        self.pool = [self._buffer(max(nbytes)) for _ in range(2)] if self.symmetric else []
        with torch.no_grad():
            for u, ps, n in zip(self.units, self.params, nbytes):
                own = self._buffer(n)
                flat = u.flatten([p.detach() for p in ps], ps[0], out=None if own is None else own.view(ps[0].dtype))
                comm.broadcast(flat, src=src, group=group, algorithm=algorithm)  # replicas start equal
                for p, v in zip(ps, u.views(flat)):
                    p.data = v  # the parameter now lives in the flat tensor
                lo, hi = u.shard_range(rank)
                self.flats.append(flat)
                self.shards.append(nn.Parameter(flat[lo:hi]))  # a view: updating it updates the model
            for b in module.buffers():
                comm.broadcast(b, src=src, group=group, algorithm=algorithm)
        self._unit_of = {id(p): i for i, ps in enumerate(self.params) for p in ps}
        self.sync = True  # False under Zero.no_sync(): backward only accumulates full-size gradients
        for ps in self.params:
            for p in ps:
                p.register_post_accumulate_grad_hook(self._on_grad)
        self._reset()

    def _buffer(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` bytes in symmetric memory (a collective allocation: every rank builds the same units
        in the same order), or None (a fresh tensor is made) off the shared-memory path."""
        return comm.symmetric_empty(nbytes, dtype=torch.uint8, group=self.group) if self.symmetric else None

    # -- backward ---------------------------------------------------------------------------
    def _reset(self) -> None:
        self._pending = [len(ps) for ps in self.params]
        self._next = 0
        self._handles: list[tuple[int, object, torch.Tensor]] = []
        self._queued = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.sync:
            return
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        self._pending[self._unit_of[id(p)]] -= 1
        while self._next < len(self.units) and self._pending[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, i: int) -> None:
        u, ps = self.units[i], self.params[i]
        buf = None
        if self.pool:
            if len(self._handles) >= 2:  # the pool buffer's last bucket must be reduced before it is rewritten
                self._handles[-2][1].wait()
            dtype = ps[0].dtype
            buf = self.pool[len(self._handles) % 2][:u.padded * dtype.itemsize].view(dtype)
        with torch.no_grad():
            flat = u.flatten([p.grad for p in ps], self.flats[i], out=buf)  # missing gradients count as zero
            flat.div_(self.world)  # pre-divide, then sum: the average
            for p in ps:
                if self.stage >= 2 or p.grad is None:
                    p.grad = None  # P_g: only the shard's gradient survives
                else:
                    # stage 1 keeps the full-size gradients (zeroed: their sum is now in flight),
                    # so a further backward before the step accumulates only new gradients
                    p.grad.zero_()
            out = torch.empty(u.shard, dtype=flat.dtype)
            h = comm.reduce_scatter(out, list(flat.view(self.world, u.shard)), op="sum", group=self.group,
                                    async_op=True, algorithm=self.algorithm)
        self._handles.append((i, h, out))

    def finish_backward(self) -> None:
        """End of backward: launch the buckets not launched yet, wait, accumulate into shard grads."""
        for i in range(self._next, len(self.units)):
            self._launch(i)
        for i, h, out in self._handles:
            h.wait()
            s = self.shards[i]
            s.grad = out if s.grad is None else s.grad.add_(out)
        self._reset()

    # -- after the optimizer step -------------------------------------------------------------
    def after_step(self) -> None:
        """All-gather each bucket's updated shards into its flat tensor (= the parameters)."""
        handles = []
        with torch.no_grad():
            for u, flat in zip(self.units, self.flats):
                lo, hi = u.shard_range(self.rank)
                handles.append(comm.all_gather(list(flat.view(self.world, u.shard)), flat[lo:hi],
                                               group=self.group, async_op=True, algorithm=self.algorithm))
        for h in handles:
            h.wait()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def full_flat(self, i: int) -> torch.Tensor:
        """Unit i's padded flat parameters (local: every rank has them)."""
        return self.flats[i]

    def zero_grad(self) -> None:
        for ps in self.params:
            for p in ps:
                p.grad = None

    def resident(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this rank holds, by kind (for memory accounting)."""
        grads = [p.grad for ps in self.params for p in ps if p.grad is not None]
        return {"params": list(self.flats), "grads": grads + [s.grad for s in self.shards if s.grad is not None]}
