"""The elastic protocol's vocabulary: the store's keys, a rank's environment, the test hooks, a change.

Shared by the coordinator (coordinator.py), the node agents (nodes.py), the rank processes' start
(ranks.py), the ranks themselves (member.py) and the fault hooks (faults.py); nothing here talks to
a store or a process group.

The store is the coordinator's (the top process, coordinator.py), so it outlives any rank. Keys
(under ``elastic/``): ``members/E`` (the coordinator's decision: ids in rank order, the step to go
on from, who left and joined, who receives the state and from whom), ``change/E`` (the coordinator wants epoch E to end), ``arrive/E/ID`` (a rank
asks into epoch E with the steps it can offer), ``ready/ID`` and ``invite/ID`` (a newcomer), ``up/E/ID``
(the barrier before the group opens), ``wd/E/`` (the watchdog's heartbeats), ``lost/E`` (epoch E
lost a member: a rank blocked in one of its calls breaks the group at once), ``step`` (the group's
step, written by rank 0 at each step's start), ``refuse/ID`` (the coordinator's one-line refusal of a stale rank).
``end/ID`` and ``news`` (a node agent's report of a rank's end), ``hb/I`` (its heartbeat),
``kill/ID`` and ``job/end`` (the coordinator's word to node agents), ``joins`` and ``refused``
(counters the ``hold`` test hook waits on).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from distrain.errors import CommError

PREFIX = "elastic/"
ENV_HOST = "DISTRAIN_ELASTIC_HOST"  # the store's host: the coordinator's (127.0.0.1) or node 0's (nodes.py)
ENV_STRIDE = "DISTRAIN_ELASTIC_STRIDE"  # ranks per node (a ZeRO replica goes one node on)
ENV_PORT, ENV_ID, ENV_NEW, ENV_RUN = ("DISTRAIN_ELASTIC_PORT", "DISTRAIN_ELASTIC_ID", "DISTRAIN_ELASTIC_NEW",
                                      "DISTRAIN_ELASTIC_RUN")
POLL_S = 0.005
BEAT_S = 1.0  # a rank's heartbeat in an elastic group (its collective watchdog's, ``wd/E/``)
STUCK_S = 2.0  # blocked this long in a call of an epoch that lost a member: the rank breaks the group
FROZEN_S = 8.0  # a member whose heartbeat has not moved for this long (once its group opened) is frozen


def key(*parts) -> str:
    return PREFIX + "/".join(str(p) for p in parts)


def env_for(port: int, ident: int, newcomer: bool, run: str, host: str = "127.0.0.1", stride: int = 1) -> dict:
    """The environment a rank process gets, which ``member.Member.from_env`` reads back."""
    return {ENV_PORT: str(port), ENV_ID: str(ident), ENV_NEW: str(int(newcomer)), ENV_RUN: run, ENV_HOST: host,
            ENV_STRIDE: str(stride)}


class Hooks:
    """Points where tests act on a rank (elastic/faults.py); the production hooks do nothing."""

    def at_step(self, member: "Member", step: int) -> None:
        """The start of ``step``, before the start-of-step copy."""

    def in_heal(self, member: "Member", step: int) -> None:
        """A newcomer's heal at ``step``: the new group is open, the state not yet sent."""

    def before_commit(self, member: "Member", step: int) -> None:
        """Replicated state: ``step``'s gradients are synchronised here, its commit not yet complete."""

    def after_commit(self, member: "Member", step: int) -> None:
        """Replicated state: ``step``'s commit completed on this rank, its update not yet applied."""

    def in_reform(self, member: "Member", step: int | None) -> None:
        """A change begins on this rank (its state at boundary ``step``), before it leaves its group."""

    def in_open(self, member: "Member", epoch: int) -> None:
        """This rank passed the barrier of epoch ``epoch`` (a change), before it joins the epoch's group."""

    def in_load(self, member: "Member", step: int) -> None:
        """A change's new group is open and its engine built; the state at ``step`` is not yet gathered."""


@dataclass
class Change:
    """What ``reform`` (or a newcomer's ``join``) decided; ``stop``: the job ends (below MIN)."""
    epoch: int
    step: int
    state: dict | None
    old_world: int
    new_world: int
    left: list = field(default_factory=list)
    joined: list = field(default_factory=list)
    rolled_back: int | None = None
    t0: float = 0.0
    stop: str | None = None
    spawned: dict = field(default_factory=dict)  # newcomer id -> when the coordinator started it (Unix s)
    t_left: float = 0.0  # when this rank left its old group (Unix s; a newcomer: when it was invited)
    source: str = "peers"  # where the state comes from: "peers", "replicas" (a lost shard), "checkpoint"
    rolled_forward: int | None = None  # replicated: the step some survivors finished by applying its update

    def event(self) -> dict:
        """The metrics.jsonl record (recover_s is added when the first step at the new size completes)."""
        return {"event": "membership", "time": time.time(), "step": self.step, "old_world": self.old_world,
                "new_world": self.new_world, "left": self.left, "joined": self.joined,
                "rolled_back": self.rolled_back, "rolled_forward": self.rolled_forward, "epoch": self.epoch,
                "state_from": self.source}


def whole_change(cut: list[dict]) -> tuple[int, list, list, float, dict]:
    """The decisions of one change, cut short by losses while the group re-formed, as one change from the
    group before the first to the group of the last: (old world, left ids, joined ids, t0 (the first
    loss), newcomers' start times). A newcomer of one decision that left in a later one is in neither."""
    left, joined, spawned = [], [], {}
    for info in cut:
        left += [i for i in info["left"] if i not in joined and i not in left]
        joined = [i for i in joined if i not in info["left"]] + [i for i in info["joined"] if i not in joined]
        spawned.update(info.get("spawned", {}))
    return cut[0]["old"], left, joined, min(info["t0"] for info in cut), spawned


def memberships(records: list, ident: int, ids: list[int]) -> list[list[int]]:
    """The ids of every epoch's group from the coordinator's ``members/E`` records (epoch 0 to this rank's,
    ``ids``: the group rank id ``ident`` opened), checked: the store is outside input. CommError for a record
    that holds no list of rank ids, or a last one that is not this rank's group."""
    out = []
    for epoch, info in enumerate(records):
        got = info.get("ids") if isinstance(info, dict) else None
        if not (isinstance(got, list) and all(isinstance(i, int) and i >= 0 for i in got) and got):
            raise CommError(f"elastic: the membership of epoch {epoch} in the store holds no list of rank ids "
                            f"({got!r}); the store is not this job's coordinator's")
        out.append(got)
    if out[-1] != ids:
        raise CommError(f"elastic: the membership of epoch {len(out) - 1} in the store ({out[-1]}) is not the "
                        f"group rank id {ident} opened ({ids})")
    return out
