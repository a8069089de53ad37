"""An elastic job over several nodes: one coordinator (node 0's agent), one node agent per other node.

``DISTRAIN_ELASTIC_NODES="I/N@HOST:PORT"`` (``distrain cluster run`` sets it on every node; on real
machines, set it yourself) makes ``distrain train --elastic MIN:MAX --nproc P`` node I of N: each
node runs P / N ranks, ids ``I*K .. I*K+K-1`` (K = P / N). Node 0's agent is the coordinator of
agent.py, with its store on HOST:PORT (node 0's address) instead of the loopback; it decides every
membership. Node I > 0 runs a node agent (:func:`run_node`, an agent.Agent of its own ids that
decides nothing): it starts and watches its own ranks and reports to the coordinator's store what
only it can see:

* ``done/ID`` (the rank's result, pickled), ``fail/ID`` (its error, a Failure), ``dead/ID`` (it died
  without a word: SIGKILL, a crash), each followed by a bump of the counter ``news``, which the
  coordinator reads once per poll (one round trip) and only then looks for the keys;
* ``hb/I``: a counter the node agent bumps every ``HB_S`` seconds. The coordinator notes when each
  node's counter last moved (on its own clock, so the hosts' clocks need not agree); a node silent for
  ``STALE_S`` is lost whole (its agent died with its ranks: a machine gone), which the survivors learn
  of at once from their broken connections, and the group re-forms without waiting for
  ``--collective-timeout``.

The coordinator asks a node agent to end one of its ranks with ``kill/ID`` (a replica of dp x tp x pp
that lost a rank), and ``job/end`` ends every node agent when the job is over, whatever the outcome.
A node agent that loses the store (the coordinator is gone) ends its ranks and exits with an error:
node 0 is the one node the job cannot lose (as torchrun's c10d store on its host).
"""

from __future__ import annotations

import os
import pickle
import re
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from distrain.elastic import member as m
from distrain.errors import ConfigError

ENV_NODES = "DISTRAIN_ELASTIC_NODES"
HB_S, STALE_S = 0.5, 3.0
_FORM = re.compile(r"^(\d+)/(\d+)@([^:]+):(\d+)$")


@dataclass(frozen=True)
class NodeSpec:
    node: int
    nodes: int
    host: str
    port: int

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
    spec = NodeSpec(int(got.group(1)), int(got.group(2)), got.group(3), int(got.group(4)))
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


def serve_store(spec: NodeSpec, world: int, timeout: float) -> dist.TCPStore:
    """The coordinator's store, on node 0's address (the other nodes reach it there)."""
    return dist.TCPStore(spec.host, spec.port, world, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout))


def client_store(spec: NodeSpec, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(spec.host, spec.port, is_master=False, timeout=timedelta(seconds=timeout))


class Remote:
    """The coordinator's view of the ranks on other nodes (what their node agents report)."""

    def __init__(self, spec: NodeSpec, nproc: int):
        self.spec, self.nproc = spec, nproc
        self.news, self.checked = 0, 0.0
        self.beats = {n: (-1, time.monotonic()) for n in range(1, spec.nodes)}  # node -> (counter, when it moved)
        self.owner = {i: n for n in range(1, spec.nodes) for i in spec.ids(nproc, n)}

    def poll(self, agent) -> None:
        """Fold the node agents' reports into ``agent`` (results, failures, lost), mark silent nodes lost."""
        store = agent.store
        news = store.add(m.key("news"), 0)
        if news != self.news:
            self.news = news
            for i in self.owner:
                if i in agent.gone:
                    continue
                if store.check([m.key("done", i)]):
                    agent.gone.add(i)
                    agent.results[i] = pickle.loads(store.get(m.key("done", i)))
                elif store.check([m.key("fail", i)]):
                    agent.gone.add(i)
                    if i not in agent.dropped:
                        agent.failures[i] = pickle.loads(store.get(m.key("fail", i)))
                elif store.check([m.key("dead", i)]):
                    self._lost(agent, i)
        now = time.monotonic()
        if now - self.checked < HB_S / 2:  # (heartbeats move every HB_S: no need to read them every poll)
            return
        self.checked = now
        for n, (count, when) in self.beats.items():
            c = store.add(m.key("hb", n), 0)
            if c != count:
                self.beats[n] = (c, now)
            elif now - when > STALE_S and c > 0:  # (judged from its first beat on: a node may start late)
                for i in self.spec.ids(self.nproc, n):  # the node is gone, its ranks with it
                    if i not in agent.gone:
                        self._lost(agent, i)

    @staticmethod
    def _lost(agent, i: int) -> None:
        agent.gone.add(i)
        if i in agent.members and i not in agent.lost:
            agent.lost[i] = time.time()
            agent._want()


def end_nodes(store) -> None:
    """Tell every node agent that the job is over (the coordinator's last word)."""
    try:
        store.set(m.key("job", "end"), "1")
    except Exception:  # noqa: BLE001 - nobody left to tell
        pass


def run_node(agent) -> int:
    """A node agent's life (``agent``: an Agent of this node's ids, not the coordinator): start its
    ranks, report them, end them when asked or when the job ends. Returns the exit status."""
    spec = agent.nodes
    agent.store = client_store(spec, agent.ctimeout)
    agent.run_id = agent.store.get(m.key("run")).decode()  # the coordinator's (waits for it: the store's time-out)
    beat = threading.Event()
    threading.Thread(target=_beat, args=(client_store(spec, agent.ctimeout), spec.node, beat), daemon=True,
                     name="distrain-elastic-heartbeat").start()  # (its own thread: starting ranks takes seconds)
    for i in agent.members:
        agent._start(i, newcomer=False)
    told: set[int] = set()
    try:
        while True:
            agent._poll()
            for i in [i for i in agent.gone if i not in told]:
                told.add(i)
                if i in agent.results:
                    agent.store.set(m.key("done", i), pickle.dumps(agent.results[i]))
                elif i in agent.failures:
                    agent.store.set(m.key("fail", i), pickle.dumps(agent.failures[i]))
                else:
                    agent.store.set(m.key("dead", i), "1")
                agent.store.add(m.key("news"), 1)
            for i in agent.members:
                if i not in agent.gone and agent.store.check([m.key("kill", i)]):
                    agent._kill(i)
            if agent.store.check([m.key("job", "end")]) or len(told) == len(agent.members):
                return 0
    except Exception as e:  # noqa: BLE001 - the store is gone: the coordinator (node 0) ended or died
        print(f"distrain: error: elastic node {spec.node}: lost the coordinator's store at {spec.host}:{spec.port} "
              f"({type(e).__name__}); ending this node's ranks", flush=True)
        return 1
    finally:
        beat.set()
        for i in agent.procs:
            agent._kill(i)


def _beat(store, node: int, stop: threading.Event) -> None:
    """Bump ``hb/NODE`` every HB_S seconds until ``stop`` (or the store is gone)."""
    while not stop.is_set():
        try:
            store.add(m.key("hb", node), 1)
        except Exception:  # noqa: BLE001 - the coordinator is gone; the main loop reports it
            return
        stop.wait(HB_S)


__all__ = ["ENV_NODES", "NodeSpec", "Remote", "end_nodes", "from_env", "run_node"]
