"""The coordinator's heartbeat watch (elastic/beats.py) on a fake store and a fake clock: exact decisions."""

import json

from distrain.elastic import beats as beats_mod
from distrain.elastic.beats import Beats
from distrain.elastic.protocol import BEAT_S, FROZEN_S, key


class FakeStore:
    def __init__(self):
        self.d: dict[str, bytes] = {}

    def set(self, k, v):
        self.d[k] = v.encode() if isinstance(v, str) else v

    def get(self, k):
        return self.d[k]

    def check(self, keys):
        return all(k in self.d for k in keys)


def beat(store, epoch, rank, n, op="", blocked=0.0):
    store.set(key("wd", epoch, "wd", rank), json.dumps({"n": n, "op": op, "blocked_s": blocked}))


def test_a_member_silent_for_frozen_s_after_the_group_opened_is_frozen_once(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(beats_mod.time, "time", lambda: now[0])
    store, b = FakeStore(), Beats()
    members = [10, 11, 12]  # ids of ranks 0, 1, 2
    assert b.watch(store, 3, members, set()) == [] and b.opened == 0.0  # no beat yet: the group is not open
    for n in range(3):
        now[0] += BEAT_S
        for r in (0, 1):  # rank 2 (id 12) never beats; rank 1 stops after n = 1
            if r == 0 or n < 2:
                beat(store, 3, r, n)
        assert b.watch(store, 3, members, set()) == []
    opened = b.opened
    assert opened == 1000.0 + BEAT_S
    now[0] = opened + FROZEN_S + 0.01  # id 12 silent since the opening, id 11 since its last beat (later)
    beat(store, 3, 0, 9)
    assert b.watch(store, 3, members, set()) == [12]
    now[0] = 1000.0 + 2 * BEAT_S + FROZEN_S + 0.01
    beat(store, 3, 0, 10)
    store.set(key("arrive", 4, 11), "{}")  # ... but id 11 has left for the next epoch: not frozen
    assert b.watch(store, 3, members, set()) == []
    store.d.pop(key("arrive", 4, 11))
    now[0] += BEAT_S
    beat(store, 3, 0, 11)
    assert b.watch(store, 3, members, {11}) == []  # out (lost or gone): not watched
    assert b.watch(store, 3, members, set()) == []  # read again within BEAT_S / 2: nothing
    now[0] += BEAT_S
    beat(store, 3, 0, 12)
    assert b.watch(store, 3, members, set()) == [11] and b.frozen == {11, 12}
    b.new_epoch()
    assert b.seen == {} and b.opened == 0.0 and b.frozen == {11, 12}


def test_what_a_late_member_does_is_read_from_its_beat_and_a_malformed_one_says_computing(monkeypatch):
    now = [50.0]
    monkeypatch.setattr(beats_mod.time, "time", lambda: now[0])
    store, b = FakeStore(), Beats()
    beat(store, 0, 0, 1, op="all_reduce(seq 7)", blocked=12.4)
    beat(store, 0, 1, 1)
    store.set(key("wd", 0, "wd", 2), b"\xff not json")
    store.set(key("wd", 0, "wd", 3), json.dumps([1, 2]))
    b.watch(store, 0, [0, 1, 2, 3, 4], set())
    assert [b.doing(i) for i in range(5)] == ["in all_reduce for 12s", "computing", "computing", "computing",
                                              "not yet in the group"]
