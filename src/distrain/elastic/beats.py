"""The coordinator's watch on its members' heartbeats: who is frozen, and what a late member is doing.

Every member's watchdog writes a beat every BEAT_S under ``wd/E/`` (comm/core/watchdog.py: a JSON record with
the call it is blocked in, ``op``, and for how long, ``blocked_s``). :class:`Beats` reads them on the
coordinator's clock, from the moment the epoch's group opened (the first beat of any member): a member whose
beat has not moved for FROZEN_S since is frozen (stopped, or a machine that hangs), and waiting for it is
waiting for the time-out, so the coordinator ends the epoch and drops it. The records are outside input: a
beat is compared as bytes, and read as JSON only to say what a late member is doing (:meth:`Beats.doing`).
"""

from __future__ import annotations

import json
import time

from distrain.elastic.protocol import BEAT_S, FROZEN_S, key


class Beats:
    def __init__(self):
        self.seen: dict[int, tuple] = {}  # member -> (its last beat seen, when it moved; this clock)
        self.read = 0.0  # when the beats were last read
        self.opened = 0.0  # when the epoch's group opened (its first beat; 0: not yet)
        self.frozen: set[int] = set()  # every member found frozen so far

    def new_epoch(self) -> None:
        self.seen, self.opened = {}, 0.0

    def watch(self, store, epoch: int, members: list[int], out) -> list[int]:
        """Every BEAT_S / 2 (else nothing): read the beats of ``members`` (rank k of epoch ``epoch`` is
        ``members[k]``) but those in ``out`` (lost or gone), and return the members newly found frozen (one that
        already arrived for the next epoch has left, and beats no more: not frozen)."""
        now = time.time()
        if now - self.read < BEAT_S / 2:
            return []
        self.read = now
        for k, i in enumerate(members):
            if i in out:
                continue
            wd = key("wd", epoch, "wd", k)
            beat = store.get(wd) if store.check([wd]) else None
            seen, _ = self.seen.get(i, (None, now))
            if beat is not None and beat != seen:
                self.seen[i] = (beat, now)
                self.opened = self.opened or now
            elif i not in self.seen:
                self.seen[i] = (None, now)
        if not self.opened:
            return []
        frozen = [i for i in members if i in self.seen and i not in out
                  and now - max(self.seen[i][1], self.opened) > FROZEN_S
                  and not store.check([key("arrive", epoch + 1, i)])]
        new = [i for i in frozen if i not in self.frozen]
        self.frozen |= set(new)
        return new

    def doing(self, i: int) -> str:
        """What member ``i`` was doing at its last beat: not yet in the group, in a call (for how long), or
        computing."""
        raw = self.seen.get(i, (None,))[0]
        if raw is None:
            return "not yet in the group"
        try:
            beat = json.loads(raw)
        except ValueError:
            beat = None
        op, blocked = (beat.get("op"), beat.get("blocked_s")) if isinstance(beat, dict) else (None, None)
        if isinstance(op, str) and op and isinstance(blocked, (int, float)):
            return f"in {op.split('(')[0]} for {blocked:.0f}s"
        return "computing"
