"""Uneven inputs: ``with model.join(): ...`` lets ranks run different numbers of batches.

torch DDP's ``model.join(divide_by_initial_world_size=True, enable=True,
throw_on_early_termination=False)`` (torch's generic ``torch.distributed.algorithms.Join``
with DDP as its one joinable), written on :mod:`distrain.comm`, so that every collective uses
the model's own ``algorithm=``. Without it a rank that runs out of batches leaves the others
waiting in their next all-reduce for ever.

One *round* per forward of a rank that still has data (an *active* rank):

* The active rank's forward first all-reduces the round vector
  ``[one-hot of the active ranks (P) | backward syncs | buffers broadcast | stop]``; then its
  buffer broadcast and bucket all-reduces follow as without join, except that buffers come
  from the highest active rank (the first rank may have run out, with stale buffers) and,
  with ``divide_by_initial_world_size=False``, gradients are divided by the number of active
  ranks instead of the group size P.
* A rank out of data is in ``__exit__``, where it all-reduces the round vector with zeros. If
  no rank is active, all have joined and the loop ends. Otherwise it *shadows* the round:
  the buffer broadcast if the active ranks broadcast, and, if they synchronize this backward,
  one bucket of zeros per bucket through the same collective (the built-in all-reduce, or the
  registered communication hook, as torch runs it), in bucket order.
* Once all have joined, every rank takes the parameters (and, with ``forward_sync_buffers``,
  the buffers) of the highest rank among those active in the last round: the replica that
  trained longest (torch's "authoritative rank"); the optimizer state stays each rank's own.

Joined ranks contribute zeros, so the sum over the group is the sum over the active ranks;
divided by P (``divide_by_initial_world_size=True``, the default) the step is as if the
joined ranks had a zero gradient, divided by the active count it is their average. With a
communication hook the hook decides the division (torch's rule too: the hooks divide by P).
``throw_on_early_termination=True``: the first rank out of data raises, and so does every
active rank at its next forward; nothing is shadowed.

Contract (torch's): inside ``join()`` a rank calls the model's forward once per synchronized
step (micro-batches under ``no_sync()`` are rounds without a backward sync); it does not
call ``allreduce_gradients()`` or other collectives on the group that joined ranks do not know.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import CommError


class Join:
    """The context manager that ``DistributedDataParallel.join()`` returns (module docstring)."""

    def __init__(self, ddp, divide_by_initial_world_size: bool = True, enable: bool = True,
                 throw_on_early_termination: bool = False):
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size
        self.enable = enable
        self.throw_on_early_termination = throw_on_early_termination
        self.ranks = dist.get_process_group_ranks(ddp.group or dist.group.WORLD)  # group rank -> global
        self.me = dist.get_rank(ddp.group)
        self._last_active: list[int] = list(range(len(self.ranks)))  # who was active in the last round

    def __enter__(self) -> Join:
        if self.enable:
            self.ddp.set_join(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.enable:
            return False
        try:
            if exc_type is None:  # an error propagates at once (torch's rule): no shadowing
                self._shadow_until_all_joined()
        finally:
            self.ddp.set_join(None)
        return False

    # -- an active rank ----------------------------------------------------------------------
    def notify(self, sync_backward: bool, sync_buffers: bool) -> int:
        """An active rank's forward: the round's all-reduce; sets the gradient divisor and
        returns the global rank to take buffers from."""
        v = self._round(active=True, sync_backward=sync_backward, sync_buffers=sync_buffers, stop=False)
        if v[-1]:
            raise CommError("DistributedDataParallel.join: a rank ran out of inputs and "
                            "throw_on_early_termination=True; every rank stops (give ranks equal numbers of "
                            "batches, or leave throw_on_early_termination=False to train on with fewer ranks)")
        active = int(v[:len(self.ranks)].sum())
        self.ddp.set_grad_divisor(self.ddp.world if self.divide_by_initial_world_size else active)
        return self._authoritative()

    # -- a joined rank -----------------------------------------------------------------------
    def _shadow_until_all_joined(self) -> None:
        P = len(self.ranks)
        while True:
            v = self._round(active=False, sync_backward=False, sync_buffers=False,
                            stop=self.throw_on_early_termination)
            if not v[:P].any():
                break  # every rank has joined
            if self.throw_on_early_termination:  # the active ranks raise in this round's forward
                raise CommError(f"DistributedDataParallel.join: rank {self.ranks[self.me]} ran out of inputs "
                                f"(throw_on_early_termination=True); every rank stops")
            if v[P + 1]:
                self.ddp.broadcast_state(params=False, src=self._authoritative())
            self.ddp.require_forward_buffer_sync = bool(v[P])  # as the active ranks' (torch's rule)
            if v[P]:
                self._shadow_backward()
        self._sync_final_model()

    def _shadow_backward(self) -> None:
        """Zeros for every bucket, through the same collectives the active ranks run."""
        # each bucket itself: on shared memory it is the symmetric counterpart of the active
        # ranks' buckets (ddp.py), which the collective needs on every rank
        pending = [self.ddp.reduce_bucket(i, b.buffer.zero_())[1] for i, b in enumerate(self.ddp.buckets)]
        for h in pending:
            h.wait()

    def _sync_final_model(self) -> None:
        self.ddp.broadcast_state(buffers=self.ddp.forward_sync_buffers, src=self._authoritative())

    # -- the round ---------------------------------------------------------------------------
    def _round(self, active: bool, sync_backward: bool, sync_buffers: bool, stop: bool) -> torch.Tensor:
        P = len(self.ranks)
        v = torch.zeros(P + 3, dtype=torch.int64)
        v[self.me] = int(active)
        v[P:] = torch.tensor([int(active and sync_backward), int(active and sync_buffers), int(stop)])
        comm.all_reduce(v, op="sum", group=self.ddp.group, algorithm=self.ddp.algorithm)
        if v[:P].any():
            self._last_active = v[:P].nonzero().flatten().tolist()
        return v

    def _authoritative(self) -> int:
        """The global rank of the highest rank active in the last round."""
        return self.ranks[max(self._last_active)]
