"""The copies a rank of a sharded elastic job (ZeRO) keeps: its own piece per step and its predecessor's replica.

A sharded rank holds one piece of the state, cut for ``(world, rank)``. At every step's start it copies the
piece (the state to roll back to) and gives that copy to the next rank, so a lost rank's piece survives on its
successor (Horovod Elastic's in-memory state; torchft's live replica). How the copy reaches the successor is
this group's choice, made once per group at the first step (:meth:`Copies.make`):

* symmetric memory (``--transport shm``, one host): :class:`pieces.InPlace`, the piece packed into a buffer the
  successor maps and reads only when the group breaks (:meth:`Copies.take`, before the group is left);
* otherwise a message: :class:`pieces.Exchange`, sent while the step computes and received at its end
  (:meth:`Copies.received`), into a buffer per step parity reused within the group.

``kept``: the copies held, each ``{step, world, rank, kind: "own"|"replica", tree, rng}`` (a replica has no
rng). The copies of the step before stay until the step's end proves every rank made the new ones (a rank may
die mid-exchange): :meth:`Copies.whole`. A piece is named by (step, world, rank) alone: the same whole state
cuts to the same pieces, so the coordinator picks the latest step whose named pieces make a whole
(quorum.sharded_target) from :meth:`Copies.offered`.
"""

from __future__ import annotations

from distrain.elastic.pieces import Exchange, InPlace, clone_tree, pack, packed_size


class Copies:
    def __init__(self):
        self.kept: list[dict] = []
        self.pending: tuple[int, Exchange] | None = None  # the exchange in flight from ``make`` to ``received``
        self.buffers: dict[int, tuple] = {}  # step parity -> (our piece's buffer, the replica's), this group's
        # this group's in-place replica; None: not tried yet in this group, False: the group has none (messages)
        self.inplace: InPlace | bool | None = None

    def new_group(self) -> None:
        """A new group: its transport is chosen anew at its first step (the copies held so far stay)."""
        self.buffers, self.inplace = {}, None

    def cut_off(self) -> None:
        """The group is left: an exchange cut off with it never counts."""
        self.pending = None

    def make(self, step: int, state, rng, rank: int, world: int, stride: int):
        """The copy of our piece ``state`` at the start of ``step`` (the tree of the copy, which is also the
        successor's replica), given to rank ``rank + stride``: collective at the group's first step (the
        in-place buffers), an exchange posted on the others when the group has no symmetric memory."""
        if self.inplace is None and world > 1:
            self.inplace = InPlace.open(packed_size(state), (rank - stride) % world) or False
        ex = None
        if self.inplace:
            tree = self.inplace.pack(step, state)
        else:
            out, theirs = self.buffers.get(step % 2, (None, None))
            buf, tree = pack(state, out)
            ex = Exchange(buf, tree, rank, world, stride, theirs) if world > 1 else None
            self.buffers[step % 2] = (buf, ex.theirs if ex is not None else None)
        mine = dict(step=step, world=world, rank=rank, kind="own", tree=tree, rng=rng)
        self.kept = [mine] + [p for p in self.kept if p["step"] in (step - 1, step)]
        self.pending = (step, ex) if ex is not None else None
        return tree

    def received(self, world: int) -> None:
        """The predecessor's piece of the step, received while we computed (the message's transport only)."""
        if self.pending is not None:
            at, ex = self.pending
            self.pending = None
            self.kept.append(dict(step=at, world=world, rank=ex.source, kind="replica", tree=ex.wait()))

    def whole(self, step: int) -> None:
        """Every rank reached ``step``'s end: every rank's copies of it are whole, the older ones go."""
        self.kept = [p for p in self.kept if p["step"] == step]

    def offered(self) -> list[list]:
        """The pieces held, as the arrive record lists them: ``[step, world, rank, kind]``."""
        return [[p["step"], p["world"], p["rank"], p["kind"]] for p in self.kept]

    def take(self, world: int, snap: dict | None) -> dict | None:
        """Before the group (and its symmetric memory) is left: our pieces copied out of our buffers (``snap``,
        the start-of-step state whose engine tree may be one of them, returned with the copy), and the whole
        pieces of the previous rank in its buffers (pieces.InPlace.replicas) kept as its replicas."""
        if not self.inplace:
            return snap
        inplace, self.inplace = self.inplace, None
        own = {id(p["tree"]): clone_tree(p["tree"]) for p in self.kept if p["kind"] == "own"}
        self.kept = [dict(p, tree=own.get(id(p["tree"]), p["tree"])) for p in self.kept]
        if snap is not None:
            snap = dict(snap, engine=own.get(id(snap["engine"]), snap["engine"]))
        self.kept += [dict(step=step, world=world, rank=inplace.source, kind="replica", tree=tree)
                      for step, tree in inplace.replicas()]
        return snap

    def keep_own(self, step: int, world: int, rank: int, state: dict) -> None:
        """``state`` ({"engine", "rng"}), held by the guard, is our piece at ``step``."""
        self.kept.append(dict(step=step, world=world, rank=rank, kind="own", tree=state["engine"], rng=state["rng"]))

    def own(self, step: int) -> dict:
        """Our own piece at ``step`` as a state ({"engine", "rng"}: None each if we kept none)."""
        p = next((p for p in self.kept if p["step"] == step and p["kind"] == "own"), None)
        return {"engine": p["tree"], "rng": p["rng"]} if p else {"engine": None, "rng": None}

    def at(self, step: int) -> list[tuple]:
        """The pieces held at ``step`` (the others dropped), as the loop gathers them: [(world, rank, tree)]."""
        self.whole(step)
        return [(p["world"], p["rank"], p["tree"]) for p in self.kept]
