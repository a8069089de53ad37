"""The coordinator's watch on its members' heartbeats: who is frozen, and what a late member is doing.

Every member's watchdog writes a beat every BEAT_S under ``wd/E/`` (comm/core/watchdog.py: a JSON record with
the call it is blocked in, ``op``, and for how long, ``blocked_s``). :class:`Beats` reads them on the
coordinator's clock, from the moment the epoch's group opened (the first beat of any member): a member whose
beat has not moved for FROZEN_S since is frozen (stopped, or a machine that hangs), and waiting for it is
waiting for the time-out, so the coordinator ends the epoch and drops it. The records are outside input: a
beat is compared as bytes, and read as JSON only to say what a late member is doing (:meth:`Beats.doing`).

:class:`News`: whether the store may hold a key the coordinator has not seen yet, its poll's gate. The coordinator
polls every 10 ms (coordinator.py) for what members write: ``arrive/E+1/ID`` (a member left its group), ``ready/ID``
(a newcomer). Looking for each member's key is a store round trip each, hundreds a second, served by the store's
thread in the coordinator's own process: 3 % of a core at P = 3 (gpt-small ps-sync on shm, 2026-12-02), taken from
the ranks on a host whose cores they fill. News answers with one round trip, the store's key count: while the group
runs whole (no change under way, no newcomer, nobody dropped) keys are only ever added (the one a rank deletes is a
newcomer's invitation), so an unchanged count says that nothing new was written since the last look, and the
coordinator skips its look. The count is read before the look it allows, so a key written during that look counts
as news at the next poll; and every FULL_S the look is made whatever the count says.
"""

from __future__ import annotations

import json
import time

from distrain.elastic.protocol import BEAT_S, FROZEN_S, key

FULL_S = 1.0  # News: the longest time between two looks at the members' keys, whatever the key count says


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


class News:
    def __init__(self):
        self.count = -1  # the store's key count before the last look (-1: none made)
        self.looked = 0.0  # when the last look was allowed (time.monotonic)

    def any(self, store, steady: bool) -> bool:
        """Whether to look at the members' keys now: always unless ``steady`` (the group runs whole, so keys
        are only added); when steady, only if the store's key count changed since the last look, or FULL_S
        passed."""
        now = time.monotonic()
        if not steady:
            self.count, self.looked = -1, now
            return True
        n = store.num_keys()
        if n != self.count or now - self.looked > FULL_S:
            self.count, self.looked = n, now
            return True
        return False
