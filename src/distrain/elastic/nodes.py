"""An elastic job over several nodes: one coordinator (node 0), one node agent per other node.

``DISTRAIN_ELASTIC_NODES="I/N@HOST:PORT"`` (``distrain cluster run`` sets it on every node; on real
machines, set it yourself) makes ``distrain train --elastic MIN:MAX --nproc P`` node I of N: each
node runs P / N ranks, ids ``I*K .. I*K+K-1`` (K = P / N). Node 0's agent is the coordinator of
coordinator.py, with its store on HOST:PORT (node 0's address) instead of the loopback; it decides every
membership. Node I > 0 runs a node agent (:func:`run_node`): it starts and watches its own ranks
through the launcher's Supervisor (as the coordinator does), decides nothing, and reports to the
coordinator's store what only it can see:

* ``end/ID``: the rank's :class:`~distrain.launch.supervisor.Outcome` (JSON: its status, its error's
  text or that it died without a word; a result only when it is JSON), followed by a bump of the
  counter ``news``, which the coordinator reads once per poll (one round trip) and only then looks for
  the keys; :meth:`Remote.poll` hands the coordinator the same Outcomes its own supervisor gives for
  local ranks (parsed strictly: :func:`outcome_from_json`);
* ``hb/I``: the node agent's beat count, written every ``HB_S`` seconds (a sealed value, not a counter:
  nobody without the secret can fake a beat, and a replayed older value does not count as one). The
  coordinator notes when each node's count last grew (on its own clock, so the hosts' clocks need not
  agree); a node silent for
  ``STALE_S`` is lost whole (its agent died with its ranks: a machine gone), which the survivors learn
  of at once from their broken connections, and the group re-forms without waiting for
  ``--collective-timeout``.

The coordinator asks a node agent to end one of its ranks with ``kill/ID`` (a replica of dp x tp x pp
that lost a rank), and ``job/end`` ends every node agent when the job is over, whatever the outcome.
A node agent that loses the store (the coordinator is gone) ends its ranks and exits with an error:
node 0 is the one node the job cannot lose (as torchrun's c10d store on its host).

The store listens on HOST only (not every interface) and is sealed with the job's secret
(distrain.sealed), which every node takes from ``DISTRAIN_JOB_SECRET`` (``distrain cluster run`` sets
it; on real machines, give every node the same value): a process without it can neither read nor
write the job's keys, and no value read from the store is ever unpickled.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from distrain import rendezvous, sealed
from distrain.elastic import protocol as m  # (the store's keys)
from distrain.elastic.ranks import Recipe, threads_per_rank
from distrain.errors import ConfigError
from distrain.launch.supervisor import Outcome, Supervisor

ENV_NODES = "DISTRAIN_ELASTIC_NODES"
HB_S, STALE_S = 0.5, 3.0
POLL_S = 0.01
_FORM = re.compile(r"^(\d+)/(\d+)@([^:]+):(\d+)$")


@dataclass(frozen=True)
class NodeSpec:
    node: int
    nodes: int
    host: str
    port: int
    secret: str = field(default="", repr=False)  # the job's (DISTRAIN_JOB_SECRET), the same on every node

    def ids(self, nproc: int, node: int | None = None) -> list[int]:
        """The rank ids that start on ``node`` (default: this one)."""
        k = nproc // self.nodes
        n = self.node if node is None else node
        return list(range(n * k, (n + 1) * k))


def _match():
    return _FORM.match(os.environ.get(ENV_NODES, "").strip())


def from_env(nproc: int) -> NodeSpec | None:
    """This node's place in a multi-node elastic job, or None (one host); ConfigError on a bad value."""
    text = os.environ.get(ENV_NODES, "")
    if not text:
        return None
    got = _match()
    if got is None:
        raise ConfigError(f"{ENV_NODES}={text!r} is malformed: give NODE/NODES@HOST:PORT, e.g. 1/2@10.0.0.1:29400")
    if not os.environ.get(sealed.ENV):
        raise ConfigError(f"{ENV_NODES} is set (an elastic job over several nodes), but {sealed.ENV} is not: every "
                          f"node needs the job's secret, the same value on each (make one with `distrain secret`), so "
                          f"that nobody else on the network can reach the coordinator's store")
    sealed.check(os.environ[sealed.ENV])
    spec = NodeSpec(int(got.group(1)), int(got.group(2)), got.group(3), int(got.group(4)), os.environ[sealed.ENV])
    if not 0 <= spec.node < spec.nodes:
        raise ConfigError(f"{ENV_NODES}={text!r}: node {spec.node} is not one of 0..{spec.nodes - 1}")
    if nproc % spec.nodes:
        raise ConfigError(f"--elastic over {spec.nodes} nodes: --nproc {nproc} does not split evenly into them; give "
                          f"a multiple of {spec.nodes}")
    return spec


def follower() -> bool:
    """Whether this process is node I > 0 of a multi-node elastic job (node 0 holds the run folder:
    its lock, the check that it is empty, every file written into it)."""
    got = _match()
    return got is not None and int(got.group(1)) > 0


def serve_store(spec: NodeSpec, world: int, timeout: float) -> sealed.SealedStore:
    """The coordinator's store, listening on node 0's address HOST only (the other nodes reach it there),
    sealed with the job's secret; ConfigError when HOST is no address of this machine or PORT is taken."""
    store = rendezvous.listening_store(spec.host, spec.port, timedelta(seconds=timeout), world)
    if store is None:
        raise ConfigError(f"{ENV_NODES}: node 0 cannot listen on {spec.host}:{spec.port} ({spec.host} is no address of "
                          f"this machine, or the port is taken); give node 0's own address and a free port")
    return sealed.SealedStore(store, spec.secret.encode())


def client_store(spec: NodeSpec, timeout: float) -> sealed.SealedStore:
    store = dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=timeout))
    return sealed.SealedStore(store, spec.secret.encode())


STATUSES = ("ok", "err", "died")


def outcome_json(o: Outcome) -> str:
    """A rank's outcome as a node agent reports it: JSON, its result only when that is JSON itself
    (the coordinator needs a remote rank's status and error; the job's result is rank 0's, on node 0)."""
    try:
        value = json.loads(json.dumps(o.value, allow_nan=False))
    except (TypeError, ValueError):
        value = None
    return json.dumps({"ident": o.ident, "status": o.status, "value": value, "when": o.when,
                       "secondary": bool(o.secondary), "exitcode": o.exitcode})


def outcome_from_json(data: bytes, ident: int) -> Outcome:
    """The outcome of rank ``ident`` from a node agent's report; ConfigError when it is not one (wrong
    fields, types or rank: a report is data, checked before it is believed)."""
    try:
        d = json.loads(data)
        ok = (isinstance(d, dict) and d.get("ident") == ident and d.get("status") in STATUSES
              and isinstance(d.get("when"), (int, float)) and math.isfinite(d["when"])
              and isinstance(d.get("secondary"), bool)
              and (d.get("exitcode") is None or type(d["exitcode"]) is int)
              and (d["status"] == "ok" or isinstance(d.get("value"), str)))
    except (ValueError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ConfigError(f"elastic: the report of rank id {ident}'s end is malformed ({bytes(data)[:80]!r}); node "
                          f"agents and the coordinator must run the same distrain")
    return Outcome(ident, d["status"], d["value"], float(d["when"]), d["secondary"], d["exitcode"])


class Remote:
    """The coordinator's view of the ranks on other nodes (what their node agents report)."""

    def __init__(self, spec: NodeSpec, nproc: int):
        self.spec, self.nproc = spec, nproc
        self.news, self.checked = 0, 0.0
        self.beats = {n: (-1, time.monotonic()) for n in range(1, spec.nodes)}  # node -> (beats, when they grew)
        self.owner = {i: n for n in range(1, spec.nodes) for i in spec.ids(nproc, n)}

    def poll(self, store, seen: set[int]) -> list[Outcome]:
        """The outcomes of remote ranks not in ``seen`` that their node agents reported since the last
        call, and a death for every rank of a node whose heartbeat stopped."""
        out = []
        news = store.add(m.key("news"), 0)
        if news != self.news:
            self.news = news
            for i in self.owner:
                if i not in seen and store.check([m.key("end", i)]):
                    out.append(outcome_from_json(store.get(m.key("end", i)), i))
        now = time.monotonic()
        if now - self.checked < HB_S / 2:  # (heartbeats move every HB_S: no need to read them every poll)
            return out
        self.checked = now
        for n, (count, when) in self.beats.items():
            c = int(store.get(m.key("hb", n))) if store.check([m.key("hb", n)]) else 0
            if c > count:
                self.beats[n] = (c, now)
            elif now - when > STALE_S and count > 0:  # (judged from its first beat on: a node may start late)
                out += [Outcome(i, "died", f"node {n} lost (no heartbeat for {STALE_S:g}s)", time.time())
                        for i in self.spec.ids(self.nproc, n) if i not in seen]  # its ranks went with it
        return out


def end_nodes(store) -> None:
    """Tell every node agent that the job is over (the coordinator's last word)."""
    try:
        store.set(m.key("job", "end"), "1")
    except Exception:  # noqa: BLE001 - nobody left to tell
        pass


def run_node(spec: NodeSpec, nproc: int, fn, args, backend: str, timeout: float, preload, hi: int) -> int:
    """A node agent's life: start this node's ranks (``spec.ids(nproc)``) through a Supervisor, report
    each one's outcome to the coordinator's store, end one when asked (``kill/ID``) and all when the job
    ends (``job/end``). Returns the exit status (1: the coordinator's store is gone)."""
    store = client_store(spec, timeout)
    run_id = store.get(m.key("run")).decode()  # the coordinator's (waits for it: the store's time-out)
    beat = threading.Event()
    threading.Thread(target=_beat, args=(client_store(spec, timeout), spec.node, beat), daemon=True,
                     name="distrain-elastic-heartbeat").start()  # (its own thread: starting ranks takes seconds)
    sup = Supervisor(preload=["distrain.elastic.ranks", *preload], name="distrain-elastic")
    recipe = Recipe(fn, tuple(args), backend, timeout, spec.port, run_id, host=spec.host,
                    stride=nproc // spec.nodes, threads=threads_per_rank(hi, spec.nodes), secret=spec.secret)
    ids = spec.ids(nproc)
    for i in ids:
        recipe.start(sup, i, newcomer=False)
    told: set[int] = set()
    try:
        while True:
            for o in sup.poll(POLL_S):
                if o.status == "hang" or o.ident in told:
                    continue
                told.add(o.ident)
                store.set(m.key("end", o.ident), outcome_json(o))
                store.add(m.key("news"), 1)
            for i in sup.running():
                if store.check([m.key("kill", i)]):
                    sup.kill(i)
            if store.check([m.key("job", "end")]) or len(told) == len(ids):
                return 0
    except Exception as e:  # noqa: BLE001 - the store is gone: the coordinator (node 0) ended or died
        print(f"distrain: error: elastic node {spec.node}: lost the coordinator's store at {spec.host}:{spec.port} "
              f"({type(e).__name__}); ending this node's ranks", flush=True)
        return 1
    finally:
        beat.set()
        for i in sup.procs:
            sup.kill(i)
        sup.close()


def _beat(store, node: int, stop: threading.Event) -> None:
    """Write the beat count to ``hb/NODE`` every HB_S seconds until ``stop`` (or the store is gone)."""
    beats = 0
    while not stop.is_set():
        beats += 1
        try:
            store.set(m.key("hb", node), str(beats))
        except Exception:  # noqa: BLE001 - the coordinator is gone; the main loop reports it
            return
        stop.wait(HB_S)


__all__ = ["ENV_NODES", "NodeSpec", "Remote", "end_nodes", "from_env", "outcome_from_json", "outcome_json",
           "run_node"]
