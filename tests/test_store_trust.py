"""Stores nobody else can use (issue 39): the job's stores are sealed with its secret, listen on the
address given, and no value read from them is unpickled.

Before: the multi-node elastic coordinator's TCPStore listened on ``*:PORT`` whatever HOST said, had no
authentication, and the coordinator ran ``pickle.loads`` on ``elastic/end/<id>``: a pickle written there
by another user ran code as the training user; the same access could kill ranks (``elastic/kill/<id>``)
and end node agents. torchrun's rendezvous state is a pickle in the store, unpickled by every launcher.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from distrain import sealed
from distrain.rendezvous import listening_store, tagged_backend

from conftest import free_port, listening

SECRET = b"s" * 64


class _Marker:
    """A pickle that, once loaded, creates the file ``path`` (what an attacker's payload does)."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _server() -> dist.TCPStore:
    return listening_store("127.0.0.1", 0, timedelta(seconds=10))


def test_sealed_keys_are_hidden_and_forged_values_are_refused(tmp_path):
    inner = _server()
    store = sealed.SealedStore(inner, SECRET)
    store.set("elastic/members/1", json.dumps({"ids": [0, 2]}))
    store.set("elastic/end/2", "ok")
    assert json.loads(store.get("elastic/members/1")) == {"ids": [0, 2]}
    # a stranger on the port lists opaque names and reads ciphertext only
    stranger = dist.TCPStore("127.0.0.1", inner.port, is_master=False, timeout=timedelta(seconds=10))
    names = stranger.list_keys()
    assert len(names) == 2 and all(n.startswith("k/") and "elastic" not in n for n in names), names
    assert all(b"ids" not in stranger.get(n) and b"ok" != stranger.get(n)[-2:] for n in names)
    # a pickle written over a job key (the name listed) is refused with the typed error, never loaded
    marker = tmp_path / "ran"
    stranger.set(store.name("elastic/end/2"), pickle.dumps(_Marker(str(marker))))
    with pytest.raises(sealed.StoreTamperedError) as e:
        store.get("elastic/end/2")
    assert str(e.value) == (f"store key 'elastic/end/2': its value is not sealed with this job's secret (written by a "
                            f"process outside the job; store 127.0.0.1:{inner.port})")
    assert not marker.exists()
    # a value sealed with another secret, and a genuine value moved under another key, do not open either
    other = sealed.SealedStore(inner, b"o" * 64)
    other.set("elastic/step", "7")
    stranger.set(store.name("elastic/step"), stranger.get(other.name("elastic/step")))
    with pytest.raises(sealed.StoreTamperedError, match="does not open with this job's secret"):
        store.get("elastic/step")
    stranger.set(store.name("elastic/end/3"), stranger.get(store.name("elastic/members/1")))
    with pytest.raises(sealed.StoreTamperedError, match="'elastic/end/3': its value does not open"):
        store.get("elastic/end/3")


def test_sealed_store_keeps_the_store_contract():
    store = sealed.SealedStore(_server(), SECRET)
    assert store.compare_set("cs", "", "a") == b"a"  # absent and expected "": set
    assert store.compare_set("cs", "b", "c") == b"a"  # another value: unchanged, the current one back
    assert store.compare_set("cs", "a", "d") == b"d"
    assert store.compare_set("none", "x", "y") == b"x"  # absent, expected given: torch's answer
    assert not store.check(["none"])
    assert store.add("n", 2) == 2 and store.add("n", 3) == 5
    store.multi_set(["m1", "m2"], ["1", b"2"])
    assert store.multi_get(["m1", "m2"]) == [b"1", b"2"]
    store.wait(["m1"], timedelta(seconds=1))
    assert store.delete_key("m1") and not store.check(["m1"])
    with pytest.raises(sealed.ConfigError, match=r"^DISTRAIN_JOB_SECRET holds 5 character\(s\); a job secret needs at "
                                                  r"least 32"):
        sealed.check("short")
    assert len(sealed.new()) == 64 and sealed.new() != sealed.new()


def test_a_process_group_rendezvous_goes_through_the_sealed_store(tmp_path):
    """Gloo's own keys (the ranks' addresses) are sealed too: a group opens over a SealedStore and nothing
    readable is left in the plain store."""
    import distrain

    out = distrain.spawn(_sum_of_ranks, 3, timeout=60)
    assert out == [3.0, 3.0, 3.0]


def _sum_of_ranks(rank: int) -> float:
    import torch

    from distrain.runtime import _held

    assert isinstance(_held[-1], sealed.SealedStore)  # (spawn gives every job a secret: runtime.init seals)
    names = _held[-1].inner.list_keys()
    assert names and all(n.startswith("k/") for n in names), names
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def test_a_forged_rendezvous_state_is_refused_before_torch_unpickles_it(tmp_path):
    """torchrun's rendezvous state is a pickle that torch's handler loads; a state not tagged with the
    job's secret (a stranger's pickle) raises RendezvousStateError and is never loaded."""
    from torch.distributed.elastic.rendezvous.api import RendezvousStateError

    store = _server()
    backend = tagged_backend(store, "job", SECRET)
    assert backend.get_state() is None
    state, token, ok = backend.set_state(pickle.dumps({"round": 1}))
    assert ok and pickle.loads(state) == {"round": 1} and backend.get_state()[0] == state
    marker = tmp_path / "ran"
    store.set("torch.rendezvous.job", base64.b64encode(pickle.dumps(_Marker(str(marker)))))
    with pytest.raises(RendezvousStateError, match="not tagged with this job's secret"):
        backend.get_state()
    other = tagged_backend(store, "job", b"o" * 64)  # a node with another secret
    store.set("torch.rendezvous.job", base64.b64encode(b"\0" * 32 + pickle.dumps({"round": 2})))
    with pytest.raises(RendezvousStateError):
        other.get_state()
    assert not marker.exists()


# -- a multi-node elastic job (two "nodes" on this machine) and a stranger on its store's port -------

def _stranger(port: int, marker: str, seen: dict, stop: threading.Event) -> None:
    """Another local user: once the port answers, write what the old coordinator would have unpickled
    (``end/ID`` with a bump of ``news``), ask a node agent to kill a rank and end the job, then keep
    overwriting every value it can list with the pickle."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not stop.is_set():
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
            break
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(0.05)
    else:
        return
    payload = pickle.dumps(_Marker(marker))
    for i in (2, 3):
        client.set(f"elastic/end/{i}", payload)
        client.set(f"elastic/kill/{i}", "1")
    client.add("elastic/news", 1)
    client.set("elastic/job/end", "1")
    seen["names"] = client.list_keys()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stranger_on_the_elastic_store_runs_nothing_and_kills_nothing(tmp_path):
    marker = str(tmp_path / "ran")
    port = free_port()
    procs = []
    for node in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "DISTRAIN_ELASTIC_FAULTS")}
        env.update(DISTRAIN_ELASTIC_NODES=f"{node}/2@127.0.0.1:{port}", DISTRAIN_JOB_SECRET="7" * 64)
        cmd = [sys.executable, "-m", "distrain", "train", "--model", "gpt-tiny", "--data", "shakespeare", "--steps",
               "12", "--batch-size", "12", "--eval-every", "0", "--sample-chars", "0", "--no-progress", "--no-report",
               "--log-every", "1", "--nproc", "4", "--elastic", "2:4", "--strategy", "ddp", "--collective-timeout",
               "30", "--out", str(tmp_path / "run")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if node == 0:
            deadline = time.monotonic() + 60
            while not any(p == port for _, p in listening(procs[0].pid)):
                assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()[0]
                time.sleep(0.05)
            sockets = listening(procs[0].pid)
    seen, stop = {}, threading.Event()
    attacker = threading.Thread(target=_stranger, args=(port, marker, seen, stop), daemon=True)
    attacker.start()
    outs = [p.communicate(timeout=200)[0] for p in procs]
    stop.set()
    attacker.join(10)
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sockets == [("127.0.0.1", port)]  # the coordinator's store: the given address only (before: *:PORT)
    assert not os.path.exists(marker)
    mine = {"elastic/job/end", "elastic/news", *(f"elastic/{k}/{i}" for k in ("end", "kill") for i in (2, 3))}
    job = [n for n in seen["names"] if n not in mine]
    assert job and all(n.startswith("k/") for n in job), seen  # the job's own keys: opaque names
    rows = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "event" not in r] == list(range(12))
    assert not [r for r in rows if "event" in r]  # no rank was killed, no membership changed
