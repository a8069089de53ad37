"""The coordinator's poll gate (elastic/beats.py: News) on the real sealed store: it skips the members' keys only while
the group runs whole and the store's key count stands still, and never longer than FULL_S."""

from datetime import timedelta

import torch.distributed as dist

from distrain import sealed
from distrain.elastic import beats as beats_mod
from distrain.elastic.beats import FULL_S, News
from distrain.elastic.protocol import key
from distrain.launch import local_store


def test_steady_the_members_keys_are_looked_at_only_when_the_store_holds_a_new_key_or_after_full_s(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(beats_mod.time, "monotonic", lambda: now[0])
    server = local_store(1, 30)
    store = sealed.SealedStore(server, sealed.new().encode())
    store.set(key("step"), "3")
    n = News()
    assert n.any(store, steady=True)  # the first look
    now[0] += 0.01
    assert not n.any(store, steady=True)  # nothing new
    store.set(key("step"), "4")  # a key written again: not new
    now[0] += 0.01
    assert not n.any(store, steady=True)
    store.set(key("arrive", 1, 2), "{}")  # a member arrived for the next epoch: looked at at the next poll
    now[0] += 0.01
    assert n.any(store, steady=True)
    now[0] += 0.01
    assert not n.any(store, steady=True)
    now[0] += FULL_S + 0.01  # the longest wait: a look whatever the count
    assert n.any(store, steady=True)
    assert not n.any(store, steady=True)
    assert n.any(store, steady=False) and n.any(store, steady=False)  # a change under way: every poll looks
    assert n.any(store, steady=True)  # (and the next steady poll looks before it trusts a count again)
    assert not n.any(store, steady=True)


def test_a_key_written_by_another_client_counts_as_news():
    server = local_store(2, 30)
    secret = sealed.new().encode()
    coord = sealed.SealedStore(server, secret)
    rank = sealed.SealedStore(dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                            timeout=timedelta(seconds=30)), secret)
    n = News()
    assert n.any(coord, steady=True)
    assert not n.any(coord, steady=True)
    rank.set(key("arrive", 1, 0), "{}")
    assert n.any(coord, steady=True) and coord.check([key("arrive", 1, 0)])
