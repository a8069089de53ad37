"""Guards: how membership enters the one training loop (trainer/loop.py) at fixed points.

The loop calls its guard at four points; a fixed job's :class:`Guard` does nothing at any of them,
an elastic job's :class:`ElasticGuard` runs the quorum of distrain.elastic.member:

    engine, start = guard.enter(make_engine, model, start, load_checkpoint)   # before the first step
    guard.begin(step, engine)            # start of a step: the state to roll back to
    guard.end(step, engine, record)      # end of a step: "is the group still whole?" (+ the loss sum)
    ... the loop's own evaluation, metrics lines and checkpoints ...
    if the step raised and guard.failed(exc), or guard.wanted:
        live = guard.keep(engine); engine = None
        engine, step, stop = guard.recover(live)    # a new group, a new engine, the step to go on from

``make_engine(net=None)`` builds an engine on the current process group (the loop's: the same
config with ``nproc`` = the group's size, the loss scaled for the rank's part at construction);
the guard calls it whenever the group changes, so an engine never sees a dead rank.

Elastic exactness: the global batch of step s is the same whatever the world size (the sampler's
``part``), each replica's loss is scaled by n_d * D / B (Engine: part_loss), and every step's loss is
summed over the group in ``end`` (one all-reduce with the change flag), so metrics.jsonl holds the
global batch's loss step by step; a rolled-back step's line is dropped and written again.
Membership changes are lines with ``"event"`` (written by rank 0 when the first step at the new
size completes: :meth:`ElasticGuard.events`).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from distrain import checkpoint, comm
from distrain.errors import TrainingError
from distrain.trainer.metrics import read_events


class Guard:
    """A fixed job's guard: the group never changes, so every hook is a no-op."""

    wanted = False  # a change asked for at the end of the last step (never, here)

    def enter(self, make_engine, model, start: int, load_checkpoint):
        """The first engine, and the step to start from (``load_checkpoint(engine)`` on a resume)."""
        engine = make_engine(model)
        if load_checkpoint is not None:
            load_checkpoint(engine)
        return engine, start

    def begin(self, step: int, engine) -> None:
        """The start of ``step``."""

    def end(self, step: int, engine, record: dict) -> None:
        """The end of ``step``: ``record["loss"]`` stays this rank's tensor (the loop sums the pending
        losses over the engine's loss group when it writes them)."""

    def failed(self, exc: BaseException) -> bool:
        """Whether the loop should recover from ``exc`` (never: a fixed job fails with it)."""
        return False

    def checkpointed(self, step: int) -> None:
        """A checkpoint set of ``step`` is committed."""

    def keep(self, engine) -> dict | None:
        """What of ``engine``'s state to keep across a change (a fixed job has none)."""
        return None

    def recover(self, live: dict | None):
        """(engine, step, stop reason) after a change; a fixed job's group never changes."""
        raise TrainingError("a fixed job's group cannot change; run with --elastic MIN:MAX to survive lost ranks")

    def events(self) -> list[dict]:
        """Event lines for metrics.jsonl, before the step lines being written (rank 0)."""
        return []

    def summary(self, out: Path) -> dict:
        """Extra summary fields (rank 0, after training)."""
        return {}


class ElasticGuard(Guard):
    """One rank of an elastic job: the quorum of its Member (distrain.elastic.member) at the loop's points.

    ``load_pieces(engine, pieces, step)`` loads the whole state joined from ZeRO pieces (every rank's
    own and replica pieces, gathered here), ``load_from_checkpoint(engine)`` the last committed
    checkpoint whatever its layout (both the loop's: checkpoint/reshard.py)."""

    def __init__(self, cfg, member, load_pieces, load_from_checkpoint):
        self.cfg, self.q = cfg, member
        self.load_pieces, self.load_from_checkpoint = load_pieces, load_from_checkpoint
        self.make_engine = None
        self.wanted = False
        self.pending_event: dict | None = None  # the change whose first step is not done yet
        self.copy_s = 0.0

    # -- entering the job -------------------------------------------------------------------------
    def enter(self, make_engine, model, start: int, load_checkpoint):
        q, self.make_engine = self.q, make_engine
        if load_checkpoint is not None:
            q.ckpt_step = start
        q.sharded = self.cfg.strategy.startswith("zero")  # each rank holds a piece of the state (ZeRO)
        change = q.join(start)  # a newcomer waits here for a step boundary, then gets the state
        try:
            engine = make_engine(model)
            if change is not None:
                self._load(engine, change)
        except Exception as e:  # noqa: BLE001 - a newcomer: a peer lost while its first engine was built or loaded
            if change is None or not q.failed(e):
                raise
            engine, change = self._rebuild(lambda: None)  # it offers the state it was sent
        if change is not None:
            self.pending_event = change.event() | {"t0": change.t0, "spawned": change.spawned, "t_left": 0}
            return engine, change.step
        if load_checkpoint is not None:
            load_checkpoint(engine)
        return engine, start

    # -- once per step ----------------------------------------------------------------------------
    def begin(self, step: int, engine) -> None:
        t = time.perf_counter()
        self.q.begin(step, engine.state_dict)  # the start-of-step copy (+ ZeRO: the replica exchange)
        self.copy_s = time.perf_counter() - t

    def end(self, step: int, engine, record: dict) -> None:
        """The quorum: the step's loss summed over the group (``record["loss"]`` becomes a float) and
        whether the group must change (``wanted``). Collective."""
        total, self.wanted = self.q.end(step, record["loss"], engine.loss_weight)
        record.update(loss=total, world=self.q.world, copy_s=self.copy_s)

    def failed(self, exc: BaseException) -> bool:
        return self.q.failed(exc)

    def checkpointed(self, step: int) -> None:
        self.q.ckpt_step = step  # (sharded state: the fallback when a piece is lost with its replica)

    def events(self) -> list[dict]:
        """The membership line, once the first step at the new size is done (the change is complete);
        after a stop below MIN, the stop line."""
        e, self.pending_event = self.pending_event, None
        if e is None or e.get("event") == "stop":
            return [e] if e is not None else []
        now = time.time()
        done = {k: v for k, v in e.items() if k not in ("t0", "spawned", "t_left")}
        done.update(recover_s=now - e["t0"], pause_s=now - (e["t_left"] or now), time=now)
        if e["joined"]:
            done["join_s"] = now - min(e["spawned"].get(str(i), now) for i in e["joined"])
        return [done]

    # -- a membership change ----------------------------------------------------------------------
    def keep(self, engine) -> dict | None:
        """The live state, when this rank's is at a step boundary (it may be the one to go on from):
        a copy, so that the engine (and its hold on the old group) can be dropped."""
        from distrain.elastic.pieces import clone_tree

        return clone_tree(engine.state_dict()) if self.q.live is not None else None

    def recover(self, live: dict | None):
        """A new group of the live ranks, a new engine on it holding the agreed state; returns
        (engine, the step to go on from, the stop reason or None)."""
        self.wanted = False
        engine, c = self._rebuild(lambda: live)
        self.pending_event = c.event() | ({"event": "stop", "reason": c.stop} if c.stop is not None else
                                          {"t0": c.t0, "spawned": c.spawned, "t_left": c.t_left})
        return engine, c.step, c.stop

    def _rebuild(self, state_fn):
        """A new group and a new engine holding the agreed state; again while peers fail meanwhile."""
        while True:
            c = self.q.reform(state_fn)
            try:
                engine = self.make_engine()
                self._load(engine, c)
                return engine, c
            except Exception as e:  # noqa: BLE001 - a peer lost while the engine was built (DDP's broadcast)
                if not self.q.failed(e):
                    raise

    def _load(self, engine, c) -> None:
        """Load the state a membership change agreed on into ``engine`` (built on the new group).

        Replicated state (ddp, ps-sync servers): the copy this rank holds or was sent. Sharded state
        (ZeRO): every rank brings the pieces it holds at the step (its own, and its replica of its
        predecessor's), all are gathered (a collective), joined into the whole model and optimizer and
        cut for the new layout (``load_pieces``, as ``--reshard`` does). ``source == "checkpoint"``: the
        last committed checkpoint, read from disk."""
        q = self.q
        if c.source == "checkpoint":
            self.load_from_checkpoint(engine)
        elif q.sharded:
            held = [None] * q.world
            comm.all_gather_object(held, (c.state["pieces"], c.state["rng"]))
            self.load_pieces(engine, [p for ps, _ in held for p in ps], c.step)
            if c.state["rng"] is None:  # no state of ours at that step: the first rank's generator that has one
                c.state["rng"] = next(rng for _, rng in held if rng is not None)
        else:
            engine.load_state_dict(c.state["engine"])
        torch.set_rng_state(c.state["rng"])

    def summary(self, out: Path) -> dict:
        events = [e for e in read_events(Path(out) / "metrics.jsonl") if e["event"] == "membership"]
        return dict(membership_changes=len(events), world_final=self.q.world,
                    ranks_left=sum(len(e["left"]) for e in events), ranks_joined=sum(len(e["joined"]) for e in events))


def stop_step(out) -> int | str:
    """The step of the committed checkpoint in ``out`` (for the stop line), or "?"."""
    try:
        return checkpoint.read_manifest(out)["step"]
    except Exception:  # noqa: BLE001 - the message names what is there
        return "?"


__all__ = ["ElasticGuard", "Guard", "stop_step"]
