"""Fault injection for tests and measurements: the one place that reads DISTRAIN_ELASTIC_FAULTS.

A :class:`~distrain.elastic.member.Member` calls its ``hooks`` at two points, ``at_step(member,
step)`` at the start of every step and ``in_heal(member, step)`` just before a newcomer's state is
sent; the production hooks (``member.Hooks``) do nothing. When the variable is set, the rank's setup
(elastic/ranks.py) installs :class:`Faults` instead, which acts on the plan:

    "1@3,2@5:stop,0@4:hold,1@2:heal,1@2:stale"

* ``ID@STEP`` (``:kill``): process ID SIGKILLs itself at the start of STEP (a real signal, so its
  peers see exactly what they see when a machine dies); ``:stop`` SIGSTOPs itself instead;
* ``:hold``: it holds the start of STEP (at most 120 s) until a newcomer is ready (the coordinator
  asks for a change, or has invited one already, or has refused a stale rank), so a newcomer joins at
  a known step;
* ``:heal``: it SIGKILLs itself in the first heal of a newcomer at step STEP or later, after the new
  group opened and just before rank 0 sends the state;
* ``:stale``: it goes silent at the start of STEP (at most 120 s) until the group has gone on to
  STEP + 2 without it, then carries on (a frozen rank coming back);
* ``:commit``: it SIGKILLs itself right after STEP's commit completed on it, before its update (the
  others have committed too: the group goes on from STEP + 1, nothing is redone);
* ``:commit-lost``: STEP's commit completes on it, then it takes its quorum for lost (a PeerLostError,
  as if the result never arrived) while the others go on: it holds the step's synchronised gradients
  and finishes the step alone when the group re-forms (a roll forward);
* ``:commit-missed``: STEP's commit does not complete on it (a PeerLostError just before) while the
  others complete it: it is a step behind them and gets the state from one of them when the group
  re-forms (replicated state whose commit rides with the gradients);
* ``:reform``: it SIGKILLs itself when it begins its first membership change at step STEP or later,
  before it leaves its group (a second loss during a recovery);
* ``:open``: it SIGKILLs itself in the first change at step STEP or later once it passed the new
  epoch's barrier, before it joins the new group (its peers are joining it: a loss inside the opening);
* ``:load``: it SIGKILLs itself in the first change at step STEP or later once the new group is open
  and its engine built, before the state is gathered (its peers are in the gather).
"""

from __future__ import annotations

import os
import signal
import time

from distrain.elastic.protocol import POLL_S, Hooks, key
from distrain.errors import PeerLostError

ENV = "DISTRAIN_ELASTIC_FAULTS"


def parse(text: str) -> dict[tuple[int, int], str]:
    """``"1@3,2@5:stop,0@4:hold"`` -> {(1, 3): "kill", (2, 5): "stop", (0, 4): "hold"}."""
    out = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        what, _, action = item.partition(":")
        ident, _, step = what.partition("@")
        out[(int(ident), int(step))] = action or "kill"
    return out


def from_env() -> Hooks:
    """The hooks of this rank: :class:`Faults` when the variable holds a plan, else the no-op Hooks."""
    plan = parse(os.environ.get(ENV, ""))
    return Faults(plan) if plan else Hooks()


def _wait(done, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(POLL_S)


class Faults(Hooks):
    """The plan's actions at the Member's hook points (see the module docstring)."""

    def __init__(self, plan: dict[tuple[int, int], str]):
        self.plan = plan

    def at_step(self, member, step: int) -> None:
        action = self.plan.get((member.ident, step))
        store = member.store
        if action == "hold":
            _wait(lambda: any(store.check([k]) for k in (key("change", member.epoch), key("joins"), key("refused"))))
        elif action == "stale":
            _wait(lambda: store.check([key("step")]) and int(store.get(key("step"))) >= step + 2)
        elif action in ("kill", "stop"):
            print(f"distrain elastic: id {member.ident} {action} at step {step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP if action == "stop" else signal.SIGKILL)

    def before_commit(self, member, step: int) -> None:
        if self.plan.get((member.ident, step)) == "commit-missed":
            raise PeerLostError(f"elastic: id {member.ident} misses the commit of step {step} (test hook)")

    def after_commit(self, member, step: int) -> None:
        action = self.plan.get((member.ident, step))
        if action == "commit":
            print(f"distrain elastic: id {member.ident} kill after the commit of step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        elif action == "commit-lost":
            raise PeerLostError(f"elastic: id {member.ident} takes the commit of step {step} for lost (test hook)")

    def in_reform(self, member, step: int | None) -> None:
        if step is not None and any(a == "reform" and i == member.ident and s <= step
                                    for (i, s), a in self.plan.items()):
            print(f"distrain elastic: id {member.ident} kill in a change at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def in_heal(self, member, step: int) -> None:
        self._kill_in_change(member, "heal", step)

    def in_open(self, member, epoch: int) -> None:
        step = member.live if member.live is not None else member.snap_step
        if epoch > 0 and step is not None:  # (epoch 0 is the job's start, not a change)
            self._kill_in_change(member, "open", step)

    def in_load(self, member, step: int) -> None:
        self._kill_in_change(member, "load", step)

    def _kill_in_change(self, member, action: str, step: int) -> None:
        if any(a == action and i == member.ident and s <= step for (i, s), a in self.plan.items()):
            print(f"distrain elastic: id {member.ident} kill in the {action} at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
