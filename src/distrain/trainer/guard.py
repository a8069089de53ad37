"""Guards: how membership enters the one training loop (trainer/loop.py) at fixed points.

The loop calls its guard at fixed points; a fixed job's :class:`Guard` does nothing at any of them,
an elastic job's :class:`ElasticGuard` runs the quorum of distrain.elastic.member:

    engine, start = guard.enter(make_engine, model, start, load_checkpoint)   # before the first step
    guard.begin(step, engine)                          # start of a step
    engine.train_step(x, y, guard.commit_hook(step, engine))   # the hook: between gradient sync and update
    guard.end(step, engine, record)                    # end of a step: the loss summed, a change wanted?
    ... the loop's own evaluation, metrics lines and checkpoints ...
    if the step raised and guard.failed(exc), or guard.wanted:
        held = guard.keep(engine); engine = None       # the states this rank can go on from
        engine, step, stop, lines, forward = guard.recover(held, lines)   # a new group, a new engine

``make_engine(net=None)`` builds an engine on the current process group (the loop's: the same
config with ``nproc`` = the group's size, the loss scaled for the rank's part at construction);
the guard calls it whenever the group changes, so an engine never sees a dead rank.

Elastic exactness: the global batch of step s is the same whatever the world size (the sampler's
``part``), each replica's loss is scaled by n_d * D / B (Engine: part_loss), and every step's loss is
summed over the group in the quorum (one all-reduce with the change flag), so metrics.jsonl holds the
global batch's loss step by step; a rolled-back step's line is dropped and written again. Membership
changes are lines with ``"event"`` (timed when the first step at the new size completes, written with
the next lines: :meth:`ElasticGuard.events`).
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

    def commit_hook(self, step: int, engine):
        """What the engine calls between its gradient sync and its update in ``step`` (None: nothing)."""
        return None

    def end(self, step: int, engine, record: dict) -> None:
        """The end of ``step``: ``record["loss"]`` stays this rank's tensor (the loop sums the pending
        losses over the engine's loss group when it writes them)."""

    def failed(self, exc: BaseException) -> bool:
        """Whether the loop should recover from ``exc`` (never: a fixed job fails with it)."""
        return False

    def checkpointed(self, step: int) -> None:
        """A checkpoint set of ``step`` is committed."""

    def keep(self, engine) -> dict:
        """What of ``engine``'s state to keep across a change (a fixed job has none)."""
        return {}

    def recover(self, held: dict, records: list[dict]):
        """(engine, step, stop reason, lines, rolled forward) after a change; a fixed job's group never changes."""
        raise TrainingError("a fixed job's group cannot change; run with --elastic MIN:MAX to survive lost ranks")

    def events(self) -> list[dict]:
        """Event lines for metrics.jsonl, before the step lines being written (rank 0)."""
        return []

    def summary(self, out: Path) -> dict:
        """Extra summary fields (rank 0, after training)."""
        return {}


class ElasticGuard(Guard):
    """One rank of an elastic job: the quorum of its Member (distrain.elastic.member) at the loop's points.

    Replicated state (ddp, dp x tp x pp replicas, ps-sync) costs no copy per step: the engine calls the
    guard's commit hook between its gradient sync and its update, the quorum is that commit, and a
    failure leaves every rank at the step's start (its RNG and buffers put back from ``begin``) or,
    when its commit was entered, able to finish the step alone (:meth:`keep`). Sharded state (ZeRO)
    copies its piece at ``begin`` (the same buffer is the replica sent to the next rank) and makes the
    quorum at ``end``.

    ``load_pieces(engine, pieces, step)`` loads the whole state joined from ZeRO pieces (every rank's
    own and replica pieces, gathered here), ``load_from_checkpoint(engine)`` the last committed
    checkpoint whatever its layout (both the loop's: checkpoint/reshard.py)."""

    def __init__(self, cfg, member, load_pieces, load_from_checkpoint):
        self.cfg, self.q = cfg, member
        self.load_pieces, self.load_from_checkpoint = load_pieces, load_from_checkpoint
        self.make_engine = None
        self.wanted = False
        self.pending_event: dict | None = None  # the change whose first step is not done yet
        self.done_events: list[dict] = []  # its line, once that step is done (written with the next lines)
        self.records: list[dict] = []  # the group's step lines not yet written, agreed at a change (_load)
        self.copy_s = 0.0
        self.guard_s = 0.0  # this rank's time in the guard's calls of the step (begin, commit, end): its per-step cost
        self.buffers: list = []  # (buffer, its value at the step's start): a forward may change buffers
        self.committed: tuple[float, bool] | None = None
        self.newcomer = False  # this rank joined with a peer's state and has not finished a step yet

    # -- entering the job -------------------------------------------------------------------------
    def enter(self, make_engine, model, start: int, load_checkpoint):
        q, self.make_engine = self.q, make_engine
        if load_checkpoint is not None:
            q.ckpt_step = start
        q.sharded = self.cfg.strategy.startswith("zero")  # each rank holds a piece of the state (ZeRO)
        change = q.join(start)  # a newcomer waits here for a step boundary, then gets the state
        self.newcomer = change is not None
        try:
            engine = make_engine(model)
            if change is not None:
                self._load(engine, change, [])
        except Exception as e:  # noqa: BLE001 - a newcomer: a peer lost while its first engine was built or loaded
            if change is None or not q.failed(e):
                raise
            engine, change = self._rebuild(None, [])  # it offers the state it was sent
        if change is not None:
            self.pending_event = change.event() | {"t0": change.t0, "spawned": change.spawned, "t_left": 0}
            return engine, change.step
        if load_checkpoint is not None:
            load_checkpoint(engine)
        return engine, start

    # -- once per step ----------------------------------------------------------------------------
    def begin(self, step: int, engine) -> None:
        t = time.perf_counter()
        self.q.begin(step, engine.piece_state)  # (sharded: the piece's copy, and its send to the next rank)
        if not self.q.sharded:
            self.buffers = [(b, b.detach().clone()) for b in engine.buffers()]
        self.committed = None
        self.copy_s = self.guard_s = time.perf_counter() - t

    def commit_hook(self, step: int, engine):
        self.q.whole = engine.holds_whole_state
        return None if self.q.sharded else _Commit(self, step, engine)

    def end(self, step: int, engine, record: dict) -> None:
        """The step's loss summed over the group (``record["loss"]`` becomes a float) and whether the group
        must change (``wanted``): the quorum (sharded), or what the commit said (replicated)."""
        t = time.perf_counter()
        if self.q.sharded:
            total, self.wanted = self.q.end(step, record["loss"], engine.loss_weight)
        else:
            if self.committed is None:
                raise TrainingError(f"elastic: {engine.label} did not call the commit hook in its step; an engine "
                                    f"that trains an elastic job calls it between its gradient sync and its update")
            (total, self.wanted), self.committed = self.committed, None
            self.q.updated(step)
        self.guard_s += time.perf_counter() - t
        record.update(loss=total, world=self.q.world, copy_s=self.copy_s, guard_s=self.guard_s)
        self.newcomer = False  # (its first step is done: the state it holds is its own)
        if self.pending_event is not None:  # the first step at the new size is done: the change is complete
            e, self.pending_event = self.pending_event, None
            self.q.settled()
            now = time.time()
            done = {k: v for k, v in e.items() if k not in ("t0", "spawned", "t_left")}
            done.update(recover_s=now - e["t0"], pause_s=now - (e["t_left"] or now), time=now)
            if e["joined"]:
                done["join_s"] = now - min(e["spawned"].get(str(i), now) for i in e["joined"])
            self.done_events.append(done)

    def failed(self, exc: BaseException) -> bool:
        return self.q.failed(exc)

    def checkpointed(self, step: int) -> None:
        self.q.ckpt_step = step  # (sharded state: the fallback when a piece is lost with its replica)

    def events(self) -> list[dict]:
        """The membership lines of the changes completed since the last call; after a stop below MIN,
        the stop line."""
        out, self.done_events = self.done_events, []
        if self.pending_event is not None and self.pending_event.get("event") == "stop":
            out, self.pending_event = out + [self.pending_event], None
        return out

    # -- a membership change ----------------------------------------------------------------------
    def keep(self, engine) -> dict[int, dict]:
        """The states this rank can go on from, as copies (so that the engine, and its hold on the old
        group, can be dropped): {step boundary: {"engine": state, "rng": generator state}}.

        Replicated: within a step, the step's start (the state is untouched before the update, or the
        engine's copy of it: Engine.start_state; the RNG and buffers come back from ``begin``) and, when the
        commit was entered (``ready``: the step's gradients are synchronised), the step finished here (the
        update applied: a roll forward); between steps, the live state. Sharded: the live state when it is at a boundary (the step's start is the piece copy)."""
        from distrain.elastic.pieces import clone_tree

        q = self.q
        self.newcomer = False  # (what it offers now is its own engine's state, a newcomer's too)
        if q.sharded:
            return {q.live: {"engine": clone_tree(engine.state_dict()), "rng": torch.get_rng_state()}} \
                if q.live is not None else {}
        if not q.in_step:
            return {q.live: {"engine": clone_tree(engine.state_dict()), "rng": torch.get_rng_state()}}
        after = [b.detach().clone() for b, _ in self.buffers]  # the buffers after the step's forward
        rng_after = torch.get_rng_state()
        with torch.no_grad():
            for b, start in self.buffers:
                b.copy_(start)
        held = {q.live: {"engine": clone_tree(engine.start_state()), "rng": q.rng}}
        if q.ready:
            with torch.no_grad():
                for (b, _), v in zip(self.buffers, after):
                    b.copy_(v)
            engine.finish_step()
            held[q.live + 1] = {"engine": clone_tree(engine.state_dict()), "rng": rng_after}
        return held

    def recover(self, held: dict[int, dict], records: list[dict]):
        """A new group of the live ranks, a new engine on it holding the agreed state; returns (engine, the
        step to go on from, the stop reason or None, the step lines not yet written, whether the group
        finished the step under way (rolled forward: its post-step work is due))."""
        self.wanted, self.buffers = False, []
        engine, c = self._rebuild(held, records)
        self.pending_event = c.event() | ({"event": "stop", "reason": c.stop} if c.stop is not None else
                                          {"t0": c.t0, "spawned": c.spawned, "t_left": c.t_left})
        return engine, c.step, c.stop, self.records, c.rolled_forward is not None

    def _rebuild(self, held, records: list[dict]):
        """A new group and a new engine holding the agreed state; again while peers fail meanwhile."""
        while True:
            c = self.q.reform(held)
            held = None  # (a retry offers what this rank settled on)
            try:
                engine = self.make_engine()
                self._load(engine, c, records)
                return engine, c
            except Exception as e:  # noqa: BLE001 - a peer lost while the engine was built (DDP's broadcast)
                if not self.q.failed(e):
                    raise

    def _load(self, engine, c, records: list[dict]) -> None:
        """Load the state a membership change agreed on into ``engine`` (built on the new group), and agree
        on the step lines not yet written (collective: every rank of the new group, newcomers too).

        Replicated state (ddp, ps-sync servers): the copy this rank holds or was sent. Sharded state
        (ZeRO): every rank brings the pieces it holds at the step (its own, and its replica of its
        predecessor's), all are gathered, joined into the whole model and optimizer and cut for the new
        layout (``load_pieces``, as ``--reshard`` does). ``source == "checkpoint"``: the last committed
        checkpoint, read from disk. The step lines: every rank keeps the summed lines since the last write
        (only rank 0 writes them); their union is the group's (a rank that finished a step others did not
        knows its loss), cut to the steps before the one the group goes on from; the new rank 0 leaves out
        those already written."""
        q = self.q
        q.hooks.in_load(q, c.step)
        mine = (c.state.get("pieces", []), c.state["rng"]) if q.sharded else ([], None)
        held = comm.all_gather_data((*mine, records))  # (data only: tensors, numbers, containers)
        if c.source == "checkpoint":
            self.load_from_checkpoint(engine)
        elif q.sharded:
            self.load_pieces(engine, [p for ps, _, _ in held for p in ps], c.step)
            if c.state["rng"] is None:  # no state of ours at that step: the first rank's generator that has one
                c.state["rng"] = next(rng for _, rng, _ in held if rng is not None)
        elif self.newcomer:  # a peer's state (or, after a failed first step, the one it made of it)
            engine.load_newcomer(c.state["engine"])
        else:
            engine.load_state_dict(c.state["engine"])
        torch.set_rng_state(c.state["rng"])
        by_step = {r["step"]: r for _, _, rs in held for r in rs}  # (the same summed line on every rank)
        self.records = [by_step[k] for k in sorted(by_step) if k < c.step]

    def summary(self, out: Path) -> dict:
        events = [e for e in read_events(Path(out) / "metrics.jsonl") if e["event"] == "membership"]
        return dict(membership_changes=len(events), world_start=self.cfg.nproc, world_final=self.q.world,
                    ranks_left=sum(len(e["left"]) for e in events), ranks_joined=sum(len(e["joined"]) for e in events))


class _Commit:
    """One step's quorum as an engine calls it (Engine.train_step's ``commit``): ``commit(loss)`` makes it
    with its own all-reduce; an engine whose gradient all-reduce can carry a few values instead passes
    ``values(loss)`` along with its gradients and hands back the group's ``averaged(...)`` of them (its
    loss weight is 1/world, so the average is the global batch's loss)."""

    def __init__(self, guard: ElasticGuard, step: int, engine):
        self.guard, self.step, self.engine = guard, step, engine

    def __call__(self, loss) -> None:
        t = time.perf_counter()
        self.guard.committed = self.guard.q.commit(self.step, loss, self.engine.loss_weight)
        self.guard.guard_s += time.perf_counter() - t

    def values(self, loss) -> torch.Tensor:
        t = time.perf_counter()
        out = self.guard.q.carry_values(self.step, loss)
        self.guard.guard_s += time.perf_counter() - t
        return out

    def averaged(self, averages: torch.Tensor) -> None:
        t = time.perf_counter()
        self.guard.committed = self.guard.q.agreed(self.step, averages)
        self.guard.guard_s += time.perf_counter() - t


def stop_step(out) -> int | str:
    """The step of the committed checkpoint in ``out`` (for the stop line), or "?"."""
    try:
        return checkpoint.read_manifest(out)["step"]
    except Exception:  # noqa: BLE001 - the message names what is there
        return "?"


__all__ = ["ElasticGuard", "Guard", "stop_step"]
