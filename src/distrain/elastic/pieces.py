"""The state of one rank as a tree (dicts, lists, tensors), and the replica of a neighbour's piece.

An engine's ``state_dict()`` is such a tree. :func:`clone_tree` copies it (the start-of-step copy
an elastic rank rolls back to); :func:`pack` copies it into one buffer, and :class:`Exchange`
sends that buffer to the next rank while the step computes, so each rank of a group gets a copy
of its predecessor's tree, in one message each way (Horovod Elastic keeps state in memory the same way;
torchft heals from a live replica): with sharded state (ZeRO), a rank that dies leaves its piece
on its successor, so the others go on without a checkpoint. Where the group's transport has symmetric
memory (``--transport shm``, one host), :class:`InPlace` replaces the message: the tree is packed into a
buffer the successor maps, which it reads only when the group breaks.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.comm.core import tags
from distrain.comm.shm.compiled import stream_copy
from distrain.errors import TrainingError


class Fixed:
    """A part of a state tree that holds no tensor and stays as it is for its engine's life (a naming record).
    The tree functions here never walk it: :func:`leaves` skips it, and the trees :func:`clone_tree`,
    :func:`rebuild_tree` and so :func:`pack` make hold its ``value`` itself, shared (so no tree they make holds
    a Fixed: it is only in the tree an engine hands over to be copied, Engine.piece_state). Walking gpt-small's
    naming record (some 700 names, shapes and slices) three times a step cost ~1 ms of an elastic ZeRO step."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def clone_tree(obj):
    """A deep copy of a state dict: tensors cloned, containers rebuilt, other values shared (a :class:`Fixed`'s
    value too)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj.value if isinstance(obj, Fixed) else obj


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
    return tree.value if isinstance(tree, Fixed) else tree


def packed_size(tree) -> int:
    """The bytes :func:`pack` puts ``tree``'s tensors in."""
    return layout(tree)[2]


def pack(tree, out: torch.Tensor | None = None):
    """One copy of ``tree``'s tensors in a single uint8 buffer (each at a 64-byte aligned offset) and
    the same tree whose tensors are views into it: (buffer, tree of views). The buffer is what
    :class:`Exchange` sends, so the start-of-step copy and the message are one memcpy. ``out``: a
    buffer of the right size to fill (its previous contents must be no longer needed: the caller keeps
    a buffer per step parity within a group, and a state loaded from pieces is always a copy), else a
    new one (a reused buffer spares the page faults of a fresh allocation every step)."""
    flat, offsets, at = layout(tree)
    buf = out if out is not None and out.numel() == at else torch.empty(at, dtype=torch.uint8)
    return buf, unpack(buf, tree, flat, offsets, copy=True)


def layout(tree) -> tuple[list[torch.Tensor], list[int], int]:
    """Where :func:`pack` puts ``tree``'s tensors: (the tensors, their offsets, the bytes in all)."""
    flat = _flat(tree)
    offsets, at = [], 0
    for t in flat:
        offsets.append(at)
        at += -(-t.numel() * t.element_size() // 64) * 64
    return flat, offsets, at


def unpack(buf: torch.Tensor, tree, flat: list[torch.Tensor], offsets: list[int], copy=False):
    """``tree`` with each tensor replaced by a view of ``buf`` at its offset (``copy``: filled from it, by
    torch's copy, or by ``copy(view, tensor)`` when it is a function)."""
    fill = copy if callable(copy) else torch.Tensor.copy_
    views = _views(buf, flat, offsets)
    if copy:
        for v, t in zip(views, flat):
            fill(v, t.detach())
    return rebuild_tree(tree, iter(views))


def _views(buf: torch.Tensor, flat: list[torch.Tensor], offsets: list[int]) -> list[torch.Tensor]:
    """Each tensor of ``flat``'s place in ``buf`` (at its offset), as a view of its dtype and shape."""
    return [buf[o:o + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape) for t, o in zip(flat, offsets)]


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


HEAD = 64  # bytes before an in-place piece's data: int64 [1 + the step whose copy started, 1 + the one whose ended]


class InPlace:
    """The replica of the previous rank's piece without a message: each rank packs its piece, at every step's
    start, into a buffer of symmetric memory (comm.symmetric_empty, one per step parity), which the rank that
    keeps its replica maps; nothing is sent or received per step (the pack is the only copy, against the pack,
    a copy into the peer's ring and one out of it for :class:`Exchange`). The successor reads the buffers only
    when the group breaks (:meth:`replicas`, before the group's transport is closed).

    Consistency (a piece whole at one step, never half of two): every buffer starts with HEAD bytes, two int64
    stamps, 1 + a step (0, a new buffer's zeros: nothing); a pack sets the end stamp to 0, the start stamp to its
    step's, copies, then the end stamp to it. A reader copies the data out between reading the end stamp and the
    start stamp: a buffer is that step's whole piece when both equal it (a rank killed mid-pack leaves 0; one that
    started packing again meanwhile moved the start). With a buffer per step parity the piece of the step before stays whole while the next
    is packed. A piece that changes size (the optimizer's state appears at the first step) gets new buffers;
    the last pair stays readable (its step is the one before). Collective, on the default group: construction
    and a pack of a new size (every rank's piece has the same size at a step, as :class:`Exchange` needs)."""

    def __init__(self, source: int):
        self.source = source
        # the last two sizes' {"bufs", "peers", "views", "parity"}, the newest last; "dst" from the first pack into
        # them: per buffer, the dtypes and shapes of the tensors last packed into it, their views there, its stamps
        self.gens: list[dict] = []

    @classmethod
    def open(cls, nbytes: int, source: int) -> "InPlace | None":
        """Buffers for pieces of ``nbytes`` (every rank of the group calls it with the same size), of rank
        ``source`` too; None on every rank where the group has no symmetric memory."""
        inplace = cls(source)
        return inplace if inplace._grow(nbytes) else None

    def _grow(self, nbytes: int) -> bool:
        with comm.transport_errors("elastic: the replica's buffers"):  # (a peer lost: PeerLostError)
            bufs = [comm.symmetric_empty(HEAD + nbytes, dtype=torch.uint8) for _ in range(2)]
            peers = [comm.symmetric_peer(b, self.source) for b in bufs]
        if any(p is None for p in peers):
            return False
        self.gens = self.gens[-1:] + [dict(bufs=bufs, peers=peers, views=None, parity=0)]
        return True

    def pack(self, step: int, tree):
        """Pack ``tree`` (this rank's piece at the start of ``step``) into the buffer of ``step``'s parity;
        returns the tree of views into it. The views of each buffer are made once for a piece's tensors'
        dtypes and shapes and kept (``dst``): making them (a slice, a view and a reshape per tensor) cost as much
        as the copy itself, ~10 us a tensor, 0.5 ms a step for a piece of 48 tensors on this 2-core host."""
        flat, offsets, nbytes = layout(tree)
        if nbytes != self.gens[-1]["bufs"][0].numel() - HEAD and not self._grow(nbytes):
            raise TrainingError(f"elastic: no symmetric memory for the piece of step {step} ({nbytes} bytes), "
                                f"where its group had some; free /dev/shm or run with --transport torch")
        g, parity = self.gens[-1], step % 2
        buf = g["bufs"][parity]
        kinds = [(t.dtype, t.shape) for t in flat]  # (they fix the offsets too: layout)
        made = g.setdefault("dst", [None, None])
        if made[parity] is None or made[parity][0] != kinds:
            made[parity] = (kinds, _views(buf[HEAD:], flat, offsets), buf[:16].view(torch.int64))
        _, dst, head = made[parity]
        head[1] = 0
        head[0] = step + 1
        for v, t in zip(dst, flat):  # (read only after a failure)
            stream_copy(v, t.detach())
        g["views"] = rebuild_tree(tree, iter(dst))
        g["parity"] = parity
        head[1] = step + 1
        return g["views"]

    def replicas(self) -> list[tuple[int, object]]:
        """The source rank's whole pieces in its buffers, copied out: [(step, tree)] (the tree has our
        non-tensor leaves, as :meth:`Exchange.wait`'s)."""
        out = []
        for g in self.gens:
            if g["views"] is None:
                continue
            flat = _flat(g["views"])
            mine = g["bufs"][g["parity"]][HEAD:].data_ptr()
            offsets = [t.data_ptr() - mine for t in flat]  # (our views' offsets: the same in any buffer of the pair)
            for peer in g["peers"]:
                head = peer[:16].view(torch.int64)
                end = int(head[1])
                data = peer[HEAD:].clone()
                start = int(head[0])
                if end > 0 and start == end:
                    out.append((end - 1, unpack(data, g["views"], flat, offsets)))
        return out


def _flat(tree) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    leaves(tree, out)
    return out
