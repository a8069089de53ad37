"""The state of one rank as a tree (dicts, lists, tensors), and the replica of a neighbour's piece.

An engine's ``state_dict()`` is such a tree. :func:`clone_tree` copies it (the start-of-step copy
an elastic rank rolls back to); :func:`exchange` gives each rank of a group a copy of its
predecessor's tree, in one message each way (Horovod Elastic keeps state in memory the same way;
torchft heals from a live replica): with sharded state (ZeRO), a rank that dies leaves its piece
on its successor, so the others go on without a checkpoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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


def exchange(tree, rank: int, world: int):
    """Collective over the default group: send ``tree``'s tensors to rank ``rank + 1`` and return
    rank ``rank - 1``'s tree (mod ``world``). The trees must have the same structure and tensor
    shapes on every rank (ZeRO pads its pieces to equal sizes); the non-tensor leaves returned are
    ours, so the caller relabels what differs (a piece's rank). One uint8 buffer each way:
    sum of the tensors' bytes, e.g. 3 x 4 B x N/P for Adam's piece of N fp32 parameters."""
    flat: list[torch.Tensor] = []
    leaves(tree, flat)
    mine = torch.cat([t.detach().reshape(-1).contiguous().view(torch.uint8) for t in flat]) if flat else \
        torch.empty(0, dtype=torch.uint8)
    theirs = torch.empty_like(mine)
    ops = [dist.P2POp(dist.isend, mine, (rank + 1) % world), dist.P2POp(dist.irecv, theirs, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    got, at = [], 0
    for t in flat:
        n = t.numel() * t.element_size()
        got.append(theirs[at:at + n].clone().view(t.dtype).reshape(t.shape))  # (clone first: aligned for view)
        at += n
    return rebuild_tree(tree, iter(got))
