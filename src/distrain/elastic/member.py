"""One rank of an elastic job: its process group per membership epoch, the per-step quorum, healing.

The training loop's guard (trainer/guard.py: ElasticGuard) talks to a :class:`Member` only
(torchft's quorum, on plain torch.distributed):

    state = m.join()                    # enter the job (a newcomer gets the state from a live peer)
    m.begin(step, engine.piece_state)   # the start of a step (sharded state: the copy to roll back to)
    ... engine.train_step(...) ...      # replicated state: m.commit(step, loss, weight) before the update
    loss, change = m.end(step, ...)     # sharded: "is the group still whole?" (one all-reduce); replicated:
                                        # m.updated(step), the answer came with commit
    if change or the step raised and m.failed(e):   # failed: a PeerLostError, or the epoch was ended
        c = m.reform(held)              # a new group of the live ranks; c.step: where to go on, c.state: what to load

Replicated state (ddp, a dp x tp x pp replica, ps-sync's servers) needs no copy per step: the
quorum is a *commit* (one all-reduce of [loss * weight, change wanted]) that every rank makes
after its gradients are synchronised and before its update (the optimizer step) changes anything.
Until then the state is the one of the step's start (the RNG and the modules' buffers, which a
forward may change, are kept at ``begin``: a few bytes); after it, the step's. A commit that
completed on some rank proves every rank entered it, so every survivor then holds the step's
synchronised gradients (``ready``): after a failure a rank offers its state at the step's start and,
when ready, the state one step on (it applies the update itself: rolls forward). The coordinator
takes the later step when every survivor can reach it (some rank's update was already applied),
else the earlier one (the step is redone).

Engines never see a dead rank: ``reform`` destroys the default process group and opens a new one
(contiguous ranks, a fresh store prefix ``elastic/pg/<epoch>/``; with --transport shm a fresh
shared-memory transport too: new segments, named per process, group and epoch, the old ones closed
and unlinked with the old group); the loop then builds a new engine
on it and loads ``c.state``. The store is the coordinator's (the top process, coordinator.py), so it
outlives any rank; its keys, the ranks' environment, the test hooks and the change record are
protocol.py's.

Every wait is bounded: the group's collectives by its time-out (``--collective-timeout``; Gloo raises
at once on a connection reset), the store waits by a deadline; the watchdog of each epoch is set
past the group's time-out, so a hung peer surfaces as an exception here rather than ending the rank.

Steps: ``live`` is the step boundary the live state is at (replicated: always one; sharded: None
while a step is under way, and ``snap`` the boundary of the copy taken by ``begin``). After a failure
a rank offers its boundaries (replicated: ``live``, ``next`` when it can roll forward; sharded: its
pieces) and the coordinator picks one every kept survivor can reach (quorum.replicated_target,
quorum.sharded_target).

Sharded state (ZeRO, ``sharded``): a rank holds one piece; ``begin`` copies it and gives the copy to the
next rank as its replica, in place over symmetric memory or as a message (copies.Copies). A rank's arrive
record lists the pieces it holds, ``[step, world, rank, "own"|"replica"]``; the coordinator takes the
latest step whose pieces make a whole (quorum.sharded_target), or the last checkpoint when a rank
and its successor were lost at once, and the loop gathers the pieces and cuts them for the new
group (ElasticGuard._load).
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist

from distrain import comm, sealed
from distrain.comm.core import watchdog
from distrain.elastic.asker import Asker
from distrain.elastic.breaker import Breaker
from distrain.elastic.copies import Copies
from distrain.elastic.epoch_store import EpochStore
from distrain.elastic.protocol import (BEAT_S, ENV_HOST, ENV_ID, ENV_NEW, ENV_PORT, ENV_RUN, ENV_STRIDE, POLL_S,
                                       Change, Hooks, key, memberships, whole_change)
from distrain.elastic.sockets import sever
from distrain.errors import CommError, PeerLostError
from distrain.launch.title import rank_title, set_title

class Member:
    def __init__(self, store, ident: int, backend: str, timeout: float, newcomer: bool = False,
                 hooks: Hooks | None = None, run: str = "", stride: int = 1):
        self.store, self.ident, self.backend, self.timeout = store, ident, backend, timeout
        self.newcomer, self.hooks, self.run, self.stride = newcomer, hooks or Hooks(), run, max(1, stride)
        self.epoch, self.ids, self.rank, self.world = -1, [], -1, 0
        self.live: int | None = None  # boundary of the live state (sharded: None while a step is under way)
        self.snap: dict | None = None
        self.snap_step: int | None = None
        # replicated state: within a step (``begin`` to ``updated``), the RNG and buffers of its start, and
        # ``ready`` once ``commit`` was entered (the step's gradients are synchronised on every rank that
        # entered it); ``held``: {step: state} this rank can offer a new group (made by the loop's guard)
        self.in_step, self.ready, self.rng = False, False, None
        self.held: dict[int, dict] = {}
        self.whole = False  # replicated state: every rank holds all of it (any holder can send it to another)
        self.changes: list[dict] = []  # every membership event this rank went through
        # the decisions of a change not yet complete (its first step not done): a second loss during the change
        # makes it several decisions, reported as one change (_heal) from the last complete membership
        self.cut: list[dict] = []
        # sharded state (ZeRO): each rank holds one piece, (world, rank) of the layout it was cut for, and the
        # copies of its own and its predecessor's (copies.Copies); ``ckpt_step``: the last checkpoint (the
        # fallback when a piece is lost with its replica)
        self.sharded = False
        self.copies = Copies()
        self.ckpt_step: int | None = None
        self.group_store: EpochStore | None = None  # the current epoch's group's store (_open)
        self.breaker = Breaker(store)  # the watchdog's break of a group that lost a member (_interrupt)
        # rank 0's store round trips of each step (the group's step written, the change flag read), asked at
        # the step's start on a thread of their own and answered by the quorum: off the step's path
        self.asker: Asker | None = None
        self.asked: tuple[int, int, Future] | None = None  # (epoch, step, the flag's answer)

    @classmethod
    def from_env(cls, backend: str, timeout: float, hooks: Hooks | None = None) -> "Member":
        """This rank's Member, from the environment :func:`env_for` made (and the job's secret, which
        seals the coordinator's store: distrain.sealed)."""
        port = int(os.environ[ENV_PORT])
        store = sealed.SealedStore(dist.TCPStore(os.environ.get(ENV_HOST, "127.0.0.1"), port, is_master=False,
                                                 timeout=timedelta(seconds=timeout)),
                                   sealed.check(os.environ.get(sealed.ENV, "")))
        return cls(store, int(os.environ[ENV_ID]), backend, timeout, os.environ.get(ENV_NEW) == "1", hooks,
                   os.environ.get(ENV_RUN, ""), int(os.environ.get(ENV_STRIDE, "1")))

    # -- store helpers ----------------------------------------------------------------------
    def _put(self, k: str, obj) -> None:
        self.store.set(k, json.dumps(obj))

    def _get(self, k: str):
        return json.loads(self.store.get(k))

    def _wait(self, keys: list[str], what: str, abort: str | None = None) -> bool:
        """Wait until every key exists (True), or ``abort`` exists (False); CommError past the deadline."""
        deadline = time.monotonic() + 2 * self.timeout + 60
        while not self.store.check(keys):
            if abort is not None and self.store.check([abort]):
                return False
            if time.monotonic() > deadline:
                raise CommError(f"elastic: rank id {self.ident} waited {2 * self.timeout + 60:g}s for {what}")
            time.sleep(POLL_S)
        return True

    # -- entering and leaving groups ---------------------------------------------------------
    def join(self, start: int) -> Change | None:
        """Enter the job: a starting rank opens epoch 0 with its state at step ``start`` (returns
        None); a newcomer announces itself, waits to be invited at a step boundary and returns the
        Change with the state a live peer sent."""
        if not self.newcomer:
            self._wait([key("members", 0)], "the first membership")
            self._open(0, self._get(key("members", 0)))
            self.live = start
            return None
        self._put(key("ready", self.ident), {"t": time.time()})
        while True:
            self._wait([key("invite", self.ident)], "an invitation into the group")
            epoch = int(self.store.get(key("invite", self.ident)))
            info = self._get(key("members", epoch))
            self.cut.append(info)
            try:
                self._open(epoch, info)
                return self._heal(info, None)
            except Exception as e:  # noqa: BLE001 - a peer died during the heal: ask again
                if not self.failed(e):
                    raise
                self._close(broken=True)
                self._put(key("arrive", epoch + 1, self.ident), {"live": None, "snap": None, "t": time.time()})
                self.store.delete_key(key("invite", self.ident))

    def _open(self, epoch: int, info: dict) -> None:
        """Join epoch ``epoch``'s process group (a barrier first: abort if the epoch is already over)."""
        self.epoch, self.ids = epoch, list(info["ids"])
        self.copies.new_group()  # (the pieces held so far keep their buffers)
        self.rank, self.world = self.ids.index(self.ident), len(self.ids)
        set_title(rank_title(self.rank, self.world))  # (ps: its rank in the group of this epoch)
        self.store.set(key("up", epoch, self.ident), "1")
        if not self._wait([key("up", epoch, i) for i in self.ids], f"the ranks of epoch {epoch}",
                          abort=key("change", epoch)):
            raise PeerLostError(f"elastic: epoch {epoch} ended before its group opened (a peer was lost)")
        self.hooks.in_open(self, epoch)
        # the group's rendezvous waits end when the epoch loses a member (lost after the barrier: epoch_store.py;
        # not on a mere change: a newcomer waits for the group to open); held here for as long as the group lives
        self.group_store = EpochStore(self.store, epoch, key("lost", epoch), self.timeout)
        with comm.transport_errors(f"elastic: opening the group of epoch {epoch}"):  # a peer lost meanwhile
            dist.init_process_group(self.backend, store=dist.PrefixStore(key("pg", epoch) + "/", self.group_store),
                                    rank=self.rank, world_size=self.world, timeout=timedelta(seconds=self.timeout))
        # past the group's own time-out: a hung peer surfaces as the backend's exception, handled here; a beat
        # every BEAT_S (the coordinator tells a frozen member by it), and the break of a group that lost a member
        watchdog.install(dist.PrefixStore(key("wd", epoch), self.store), self.rank, self.world,
                         2 * self.timeout + 30, interval=BEAT_S, interrupt=self._interrupt)

    def memberships(self) -> list[list[int]]:
        """The ids of every epoch's group so far, in rank order (``[0]``: the starting ranks; ``[-1]``: this
        rank's group), as the coordinator decided them (its ``members/E``, checked: protocol.memberships)."""
        return memberships([self._get(key("members", e)) for e in range(self.epoch + 1)], self.ident, self.ids)

    def _interrupt(self, blocked_s: float) -> None:
        """The watchdog's thread, every beat: break this epoch's group once it lost a member (breaker.py)."""
        self.breaker.check(self.epoch, blocked_s)

    def _close(self, broken: bool = False) -> None:
        self.copies.cut_off()
        watchdog.uninstall()
        if broken and dist.is_initialized():
            sever(self.store.port)  # (its pending work ends at once; a full gc.collect() here cost 0.2-0.25 s)
        if dist.is_initialized():
            comm.close_all()
            dist.destroy_process_group()

    def close(self) -> None:
        """Leave for good (the end of the run)."""
        self._close()
        if self.asker is not None:
            self.asker.stop()
            self.asker = None

    # -- once per step ---------------------------------------------------------------------
    def begin(self, step: int, state_fn) -> None:
        """The start of ``step``. Replicated state: note the RNG (the state itself stays as it is until the
        update, after ``commit``). Sharded: copy our piece and send it to the next rank (the replica).
        Rank 0 writes the group's step and asks whether a change is wanted in the background (:meth:`_flag`
        takes the answer)."""
        if self.rank == 0:
            self.asker = self.asker or Asker()
            self.asker.submit(self.store.set, key("step"), str(step))  # (the group has reached ``step``)
        self.hooks.at_step(self, step)
        if self.rank == 0:  # (after the hook: a test holding this rank until a change is wanted sees it asked)
            self.asked = (self.epoch, step, self.asker.submit(self.store.check, [key("change", self.epoch)]))
        if not self.sharded:
            self.live, self.in_step, self.ready, self.rng, self.held = step, True, False, torch.get_rng_state(), {}
            return
        # our piece, copied once, the copy the next rank's replica (copies.Copies: in place or a message); it
        # goes one node on (``stride`` ranks: nodes hold consecutive ranks) while the group spans more than one
        # node, else to the next rank
        stride = self.stride if self.world > self.stride else 1
        rng = torch.get_rng_state()
        tree = self.copies.make(step, state_fn(), rng, self.rank, self.world, stride)
        self.snap, self.snap_step, self.live = {"engine": tree, "rng": rng}, step, None

    def offers(self) -> dict:
        """What this rank can offer a new group (its arrive record): boundaries, pieces, checkpoint."""
        out = {"live": self.live, "snap": self.snap_step, "t": time.time(), "run": self.run}
        if not self.sharded:  # the boundaries of what the guard holds: the step's start (live), one on (next)
            out.update(next=self.live + 1 if self.live is not None and self.live + 1 in self.held else None,
                       in_step=self.in_step, snap=None, whole=self.whole)
        if self.sharded:
            pieces = [[self.live, self.world, self.rank, "own"]] if self.live is not None else []
            pieces += self.copies.offered()
            out.update(pieces=pieces, ckpt=self.ckpt_step)
        return out

    def _flag(self, step: int) -> float:
        """1.0 on rank 0 when the coordinator wanted a change (a rank was lost or a newcomer waits) at the
        step's start, else 0.0: the answer to what :meth:`begin` asked (waited for if not in yet; asked here
        if ``begin`` did not ask it in this epoch). A change wanted later is seen at the next step."""
        if self.rank != 0:
            return 0.0
        asked, self.asked = self.asked, None
        if asked is not None and asked[:2] == (self.epoch, step):
            return 1.0 if asked[2].result() else 0.0
        return 1.0 if self.store.check([key("change", self.epoch)]) else 0.0

    def _quorum(self, step: int, loss, weight: float) -> tuple[float, bool]:
        """The global batch's loss of ``step`` (sum over ranks of loss * weight) and whether the group must
        change. One all-reduce."""
        t = torch.tensor([float(loss) * weight if loss is not None else 0.0, self._flag(step)], dtype=torch.float64)
        comm.all_reduce(t, algorithm="native")
        return t[0].item(), t[1].item() > 0

    def commit(self, step: int, loss, weight: float) -> tuple[float, bool]:
        """Replicated state, after the gradients of ``step`` are synchronised and before the update: the
        quorum, its own all-reduce (collective). Once entered this rank can finish the step alone
        (``ready``); the caller applies the update right after it returns, then calls :meth:`updated`."""
        self.hooks.before_commit(self, step)
        self.ready = True
        total, wanted = self._quorum(step, loss, weight)
        self.hooks.after_commit(self, step)
        return total, wanted

    def carry_values(self, step: int, loss) -> torch.Tensor:
        """The quorum riding with the gradients (DistributedDataParallel.carry: they are averaged over the
        group, so the engine's loss weight must be 1/world): [this rank's loss, the change flag]."""
        return torch.tensor([float(loss) if loss is not None else 0.0, self._flag(step)], dtype=torch.float64)

    def agreed(self, step: int, averages) -> tuple[float, bool]:
        """The quorum rode with ``step``'s gradients and arrived here with them (``averages``: the group's
        averages of :meth:`carry_values`): the global batch's loss and whether the group must change. Only
        this rank knows the commit complete; another may have failed in the same all-reduce, and it gets
        this step's state from a rank that has it (quorum.replicated_target)."""
        self.hooks.before_commit(self, step)
        self.ready = True
        self.hooks.after_commit(self, step)
        return float(averages[0]), float(averages[1]) > 0

    def updated(self, step: int) -> None:
        """Replicated state: ``step``'s update is applied; the live state is at step + 1."""
        self.live, self.in_step, self.ready = step + 1, False, False

    def end(self, step: int, loss, weight: float) -> tuple[float, bool]:
        """Sharded state, the end of ``step``: the replica received, then the quorum (collective)."""
        self.copies.received(self.world)
        total, wanted = self._quorum(step, loss, weight)
        self.live = step + 1
        self.copies.whole(step)  # every rank reached this all-reduce, so every rank finished begin(step)
        return total, wanted

    def failed(self, exc: BaseException) -> bool:
        """Whether ``exc`` is the group breaking rather than a bug of ours: a PeerLostError (the comm
        layer's type for a peer gone, silent or aborted) anywhere in its chain, or any error while the
        coordinator has already ended this epoch (``change/E``: the group is aborted). By type and
        by the store, never by the message."""
        if self.epoch >= 0 and self.store.check([key("change", self.epoch)]):
            return True
        seen = set()
        while exc is not None and id(exc) not in seen:
            seen.add(id(exc))
            if isinstance(exc, PeerLostError):
                return True
            exc = exc.__cause__ or exc.__context__
        return False

    # -- a membership change ---------------------------------------------------------------
    def reform(self, held: dict[int, dict] | None = None) -> Change:
        """Leave the current group, agree with the others (through the coordinator) on the new members and
        the step, open the new group, send the state to newcomers. ``held``: {step: {"engine", "rng"}}, the
        states this rank can go on from (the guard's copies: the live state, and for replicated state the
        step's start and one on; None: what it held at the last change). Returns the Change (``state``:
        what to load, at ``step``). Retries while peers keep failing during the change."""
        t_left = time.time()
        if held is not None:
            self.held = held
        self.snap = self.copies.take(self.world, self.snap)  # (before the group's symmetric memory is left)
        self.hooks.in_reform(self, self.live if self.live is not None else self.snap_step)
        while True:
            nxt = self.epoch + 1
            offer = self.offers()  # (before leaving: the live piece is this group's)
            self._close(broken=True)
            self._put(key("arrive", nxt, self.ident), offer)
            refused = key("refuse", self.ident)
            ok = self._wait([key("members", nxt)], f"the members of epoch {nxt}", abort=refused)
            info = self._get(key("members", nxt)) if ok else {"ids": []}
            if self.ident not in info["ids"]:  # left out (too late, or stale): the coordinator says why, in one line
                self._wait([refused], f"the coordinator's word on epoch {nxt}")
                why = self.store.get(refused).decode()
                print(f"distrain: error: {why}", file=sys.stderr, flush=True)
                self.store.set(key("refused"), str(self.ident))  # (tests: a ``hold`` ends here)
                raise CommError(why)
            self.cut.append(info)
            target, source = info["step"], info.get("source", "peers")
            if self.ident in info.get("receive", ()):  # a holder of the step sends it (_heal)
                state = None
            elif target in self.held:
                state = self.held[target]
                if self.sharded:
                    self.copies.keep_own(target, self.world, self.rank, state)
            elif self.snap_step == target or source == "checkpoint":
                state = self.snap
            elif self.sharded:  # the state of that step: our own piece if we kept it, and the replicas we hold
                state = self.copies.own(target)
            else:
                raise CommError(f"elastic: rank id {self.ident} holds steps {self.live}/{self.snap_step}, the group "
                                f"goes on from {target}")
            if self.sharded:  # the pieces we hold at the target (the loop gathers everyone's)
                state = dict(state, pieces=self.copies.at(target))
            # what we can offer if this change fails too
            self._settle(state, target)
            try:
                self._open(nxt, info)
                change = self._heal(info, state)
                change.t_left = t_left
                return change
            except Exception as e:  # noqa: BLE001 - a peer died during the change: once more
                if not self.failed(e):
                    raise

    def _heal(self, info: dict, state: dict | None) -> Change:
        """The ranks without the state at the step (newcomers; survivors behind a step their peers
        finished) get it over the new group from a rank that holds it (``sender``; rank 0 by default);
        RNG restored."""
        receive = info.get("receive", info["joined"])
        if receive:
            self.hooks.in_heal(self, info["step"])
            # replicated state: the sender sends all of it; sharded: only the RNG (the loop gathers the pieces)
            src = info.get("sender", 0)
            sent = None if self.rank != src else state if not self.sharded else {"rng": state["rng"], "engine": None}
            got = comm.broadcast_data(sent, src=src)  # (data only: tensors and containers, never a pickle)
            if state is None:
                state = got if not self.sharded else dict(got, pieces=[])
        if state["rng"] is not None:  # (sharded, no state of ours at the step: the loop takes a peer's)
            torch.set_rng_state(state["rng"])
        self._settle(state, info["step"])  # the loop loads it into a new engine
        old, left, joined, t0, spawned = whole_change(self.cut)
        return Change(self.epoch, info["step"], state, old, len(info["ids"]), left, joined,
                      info.get("rolled_back"), t0, info.get("stop"), spawned,
                      source=info.get("source", "peers"), rolled_forward=info.get("rolled_forward"))

    def settled(self) -> None:
        """The first step after the last change is done: the change is complete (a later one starts anew)."""
        self.cut = []

    def _settle(self, state: dict, step: int) -> None:
        """``state`` (at ``step``) is what this rank holds for the new group until its first step (and
        offers again if the change fails)."""
        if self.sharded:
            self.snap, self.snap_step, self.live = state, step, None
        else:
            self.held, self.live, self.in_step, self.ready = {step: state}, step, False, False


_current: Member | None = None


def install(member: Member) -> Member:
    """Make ``member`` this process's (elastic/ranks.py: Enter does it before running the rank's function)."""
    global _current
    _current = member
    return member


def current() -> Member:
    """This process's Member (an elastic rank), or CommError outside an elastic job."""
    if _current is None:
        raise CommError("elastic: this process is not a rank of an elastic job (distrain train --elastic)")
    return _current
