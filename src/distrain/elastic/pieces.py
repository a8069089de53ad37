"""The state of one rank as a tree (dicts, lists, tensors), and the replica of a neighbour's piece.

An engine's ``state_dict()`` is such a tree. :func:`clone_tree` copies it (the start-of-step copy
an elastic rank rolls back to); :func:`pack` copies it into one buffer, and :class:`Exchange`
sends that buffer to the next rank while the step computes, so each rank of a group gets a copy
of its predecessor's tree, in one message each way (Horovod Elastic keeps state in memory the same way;
torchft heals from a live replica): with sharded state (ZeRO), a rank that dies leaves its piece
on its successor, so the others go on without a checkpoint.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.comm.core import tags


def clone_tree(obj):
    """A deep copy of a state dict: tensors cloned, containers rebuilt, other values shared."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def leaves(tree, out: list) -> None:
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            leaves(v, out)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            leaves(v, out)


def rebuild_tree(tree, tensors):
    """``tree`` with its tensors replaced, in order, by those of the iterator ``tensors``."""
    if isinstance(tree, torch.Tensor):
        return next(tensors)
    if isinstance(tree, dict):
        return {k: rebuild_tree(v, tensors) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild_tree(v, tensors) for v in tree)
    return tree


def pack(tree, out: torch.Tensor | None = None):
    """One copy of ``tree``'s tensors in a single uint8 buffer (each at a 64-byte aligned offset) and
    the same tree whose tensors are views into it: (buffer, tree of views). The buffer is what
    :class:`Exchange` sends, so the start-of-step copy and the message are one memcpy. ``out``: a
    buffer of the right size to fill (its previous contents must be no longer needed: the caller keeps
    a buffer per step parity within a group, and a state loaded from pieces is always a copy), else a
    new one (a reused buffer spares the page faults of a fresh allocation every step)."""
    flat: list[torch.Tensor] = []
    leaves(tree, flat)
    offsets, at = [], 0
    for t in flat:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // 64) * 64
    buf = out if out is not None and out.numel() == at else torch.empty(at, dtype=torch.uint8)
    return buf, unpack(buf, tree, flat, offsets, copy=True)


def unpack(buf: torch.Tensor, tree, flat: list[torch.Tensor], offsets: list[int], copy: bool = False):
    """``tree`` with each tensor replaced by a view of ``buf`` at its offset (``copy``: filled from it)."""
    views = []
    for t, o in zip(flat, offsets):
        v = buf[o:o + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape)
        if copy:
            v.copy_(t.detach())
        views.append(v)
    return rebuild_tree(tree, iter(views))


class Exchange:
    """Collective over the default group, asynchronous: send the buffer of a packed tree to rank
    ``rank + stride`` and receive rank ``rank - stride``'s into one of the same size (mod ``world``),
    while the step computes (``stride``: the ranks per node, so that a copy is on another node).
    :meth:`wait` returns the predecessor's tree (views into the received buffer).
    The messages go over the group's transport (distrain.comm's point-to-point, tag
    ``tags.ELASTIC_REPLICA``): with ``--transport shm`` a copy into the peer's ring and one out of it
    (posting gpt-small's 5.2 MB piece at P = 2 to Gloo's TCP loopback cost 4 ms a step on a loaded host).
    The trees must have the same structure and tensor shapes on every rank (ZeRO pads its pieces
    to equal sizes); the non-tensor leaves are ours, so the caller relabels what differs (a piece's
    rank). Bytes each way: the tree's, e.g. 3 x 4 B x N/P for Adam's piece of N fp32 parameters."""

    def __init__(self, buf: torch.Tensor, views, rank: int, world: int, stride: int = 1,
                 theirs: torch.Tensor | None = None):
        self.views = views
        self.theirs = theirs if theirs is not None and theirs.numel() == buf.numel() else torch.empty_like(buf)
        self.source = (rank - stride) % world  # whose piece we hold
        tag = tags.ELASTIC_REPLICA.start
        with comm.transport_errors("elastic: the replica exchange"):  # (a peer lost: PeerLostError)
            self.works = [comm.isend(buf, (rank + stride) % world, tag=tag, label="elastic_replica"),
                          comm.irecv(self.theirs, self.source, tag=tag, label="elastic_replica")]

    def wait(self):
        with comm.transport_errors("elastic: the replica exchange"):
            for w in self.works:
                w.wait()
        flat: list[torch.Tensor] = []
        leaves(self.views, flat)  # (views into our buffer: their offsets are the same in the peer's)
        return unpack(self.theirs, self.views, flat, [t.storage_offset() * t.element_size() for t in flat])
