"""The top process of an elastic job: the quorum's coordinator, a layer on the launcher's supervisor.

Contract of :func:`run` (``distrain train --elastic MIN:MAX`` calls it where a fixed job calls distrain.spawn):
``fn(ident, *args)`` runs in every rank process after :func:`distrain.elastic.member.current` is set up (the
process group is opened by the rank itself, through ``Member.join``); ids are 0..nproc-1 for the first ranks and
count on for newcomers. It returns ``{ident: fn's value}`` for the ranks of the last membership, or raises:
RankFailedError when a rank fails in its own code, TrainingError when no rank with the state is left,
SpawnTimeoutError past ``timeout``.

Processes are the launcher's: the coordinator starts, watches and ends its ranks through
:class:`distrain.launch.supervisor.Supervisor` (as spawn does), and folds every
:class:`~distrain.launch.supervisor.Outcome` (of a local rank, or of a rank on another node as its node agent
reports it: elastic/nodes.py) into the membership through one method, :meth:`fold`. The coordinator (torchft's
lighthouse, in the process that outlives every rank) hosts the store, so a new membership never depends on a rank
that may be gone. It watches the ranks (a SIGKILLed one is seen at once by its sentinel) and the store (beats.News):

1. a change is wanted when a member dies, when a member arrives for the next epoch on its own (it saw
   its group break: a time-out, a reset connection), or when a newcomer is ready: ``change/E`` is set,
   which every member sees at its next step boundary (rank 0 reads it, the step's all-reduce spreads it);
2. it waits for every live member to arrive (``arrive/E+1/ID`` with the steps it can offer). When the
   change is a loss (a death, or a member that arrived: it left the group) it also sets ``lost/E``, and a
   member blocked in a call of the epoch breaks the group (member.py) and arrives within seconds. A member
   whose heartbeat (its watchdog's, every BEAT_S) has not moved for FROZEN_S is frozen and dropped at
   once; one that is alive but silent (computing) is waited for, with one line saying for whom after a
   few seconds, until ``collective_timeout`` after the change began, then dropped (counted as lost). If
   a dropped member comes back later, or a rank arrives with another run's id, it is refused: ``refuse/ID``
   holds one line naming its step and the group's (or the two run ids), which the rank raises as its
   error; a refused rank does not fail the job;
3. it decides: the step to go on from is the smallest any survivor offers (each can offer its live
   state or its start-of-step copy), the members are the survivors in their old order then the
   newcomers (up to MAX), written to ``members/E+1``; below MIN the survivors get ``stop`` and the
   job ends cleanly (they write a checkpoint first).

With ``replace`` > 0 it starts that many replacement ranks over the run, each while the job is below
MAX; a replacement joins at a step boundary and is healed from a live peer (member.py).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import uuid
from typing import Any, Callable, Sequence

from distrain import sealed
from distrain.blame import Failure, blame
from distrain.elastic import protocol as m  # (the store's keys)
from distrain.elastic.beats import Beats, News
from distrain.elastic import nodes as multinode
from distrain.elastic.quorum import reachable, refusal, replicated_target, rolled_back, sharded_target, whole_replicas
from distrain.elastic.ranks import Recipe, threads_per_rank
from distrain.errors import ConfigError, SpawnTimeoutError, TrainingError
from distrain.launch import local_store
from distrain.launch.cores import core_slices, free_core_slices
from distrain.launch.supervisor import Outcome, Supervisor

POLL_S = 0.01
SAY_S = 5.0  # waiting this long for members to leave an ended epoch: say for whom


class Coordinator:
    def __init__(self, fn, args: Sequence, nproc: int, lo: int, hi: int, replace: int, backend: str,
                 timeout: float | None, collective_timeout: float, preload: Sequence[str] = (),
                 grid: tuple[int, int] = (1, 1), nodes=None, servers: int = 0, bind_cores: bool | None = False):
        self.fn, self.args, self.nproc, self.lo, self.hi, self.replace = fn, tuple(args), nproc, lo, hi, replace
        self.grid = grid  # (tp, pp): the members go and stay by whole model replicas of tp x pp ranks
        self.nodes = nodes  # nodes.NodeSpec of a multi-node job (None: one host)
        self.servers = servers  # ps-sync: the last ``servers`` members serve (newcomers join before them)
        self.remote = None  # node 0 of several: nodes.Remote, the other nodes' ranks as their agents report them
        self.backend, self.timeout, self.ctimeout = backend, timeout, collective_timeout
        self.sup = Supervisor(preload=["distrain.elastic.ranks", *preload], name="distrain-elastic")
        self.recipe: Recipe | None = None  # (the store's port is known once it is open: run())
        self.results: dict[int, Any] = {}
        self.started: dict[int, float] = {}  # local ids -> when they were started (Unix s)
        self.failures: dict[int, Failure] = {}
        self.gone: set[int] = set()  # processes that ended (result, error or death)
        self.epoch, self.members, self.lost = 0, list(range(nproc)), {}
        self.waiting: dict[int, float] = {}  # newcomers started, not yet members: id -> start time
        self.want: float | None = None  # when the current change began (None: the group is whole)
        self.stop: str | None = None
        self.next_id = nproc
        self.events: list[dict] = []
        self.run_id = uuid.uuid4().hex[:12]  # a rank of another run (another store, same port) is refused
        self.dropped: dict[int, int] = {}  # members dropped while alive (silent): id -> the epoch they would arrive at
        self.refused: dict[int, str] = {}  # id -> the one-line refusal it was given
        # the current epoch's heartbeats, the members found frozen (_watch_beats); news: whether the store may hold
        self.beats, self.news = Beats(), News()  # a key of the members' not seen yet (one round trip a poll)
        self.said = -1  # the epoch whose wait was told
        self.why: dict[int, str] = {}  # lost ids -> why they left (killed by SIGKILL, exit code 1, frozen, ...)
        # cores per rank, as a fixed job's spawn binds them (launch/cores.py): MAX slots of cores, chosen at the
        # start (one host only); a rank takes a slot no running rank holds (a newcomer, the slot of one gone)
        self.bind_cores, self.slices = bind_cores, None
        self.slot: dict[int, int] = {}  # id -> its slot in ``slices``

    # -- processes ----------------------------------------------------------------------------
    def _start(self, ident: int, newcomer: bool) -> None:
        self.recipe.start(self.sup, ident, newcomer, cores=self._cores(ident))
        self.started[ident] = self.sup.started[ident]

    def _cores(self, ident: int) -> list[int] | None:
        """The cores of a free slot for ``ident`` (None: unbound, when not binding or every slot is held: a
        dropped member may still run on its own)."""
        if self.slices is None:
            return None
        held = {s for i, s in self.slot.items() if i not in self.gone}
        free = next((k for k in range(len(self.slices)) if k not in held), None)
        if free is None:
            return None
        self.slot[ident] = free
        return self.slices[free]

    def _kill(self, ident: int) -> None:
        if ident not in self.sup.procs:  # a rank of another node: its agent ends it
            self.store.set(m.key("kill", ident), "1")
            return
        self.sup.kill(ident)

    def fold(self, o: Outcome) -> None:
        """One rank's outcome (a local process's, or a remote one as its node agent reported it)."""
        i = o.ident
        if i in self.gone or o.status == "hang":  # (an elastic rank's watchdog ends it: a death follows)
            return
        self.gone.add(i)
        if o.status == "ok":
            self.results[i] = o.value
        elif o.status == "err" and i in self.dropped:
            pass  # out of the job already (refused, or gave up waiting): not the job's failure
        elif o.status == "err":
            self.failures[i] = Failure(i, o.when, o.value, secondary=o.secondary)
        else:  # died without a word: SIGKILL, os._exit, a crash, a lost node
            if i in self.members and i not in self.lost:  # (not one the coordinator ended: it is out already)
                code = o.exitcode
                self.why[i] = ("on a lost node" if code is None and i not in self.sup.procs
                               else f"killed by {signal_name(-code)}" if code is not None and code < 0
                               else f"exit code {code}")  # (said in the change's line: _say_change)
                self.lost[i] = time.time()
                self._want(lost=True)
            self.waiting.pop(i, None)

    def _poll(self) -> None:
        for o in self.sup.poll(POLL_S):
            self.fold(o)

    # -- membership ---------------------------------------------------------------------------
    def _want(self, lost: bool = False) -> None:
        """End the current epoch (``change/E``); ``lost``: it lost a member (``lost/E``: its blocked calls
        cannot complete, member.py breaks them)."""
        if self.want is None:
            self.want = time.time()
            self.store.set(m.key("change", self.epoch), "1")
        if lost:
            self.store.set(m.key("lost", self.epoch), "1")

    def _step_membership(self) -> None:
        if any(i in self.results for i in self.members):
            return  # the job is ending: no more changes
        nxt = self.epoch + 1
        survivors = [i for i in self.members if i not in self.lost]
        ready = [i for i in self.waiting if self.store.check([m.key("ready", i)])]
        arrived = {i: json.loads(self.store.get(m.key("arrive", nxt, i)))
                   for i in survivors if self.store.check([m.key("arrive", nxt, i)])}
        for i, r in [(i, r) for i, r in arrived.items() if r.get("run", self.run_id) != self.run_id]:
            del arrived[i]  # another run's state: refused, left out like a lost rank
            survivors.remove(i)
            self._refuse(i, r, nxt)
            self.lost[i] = time.time()
            self.why[i] = "another run's state"
        if arrived:
            self._want(lost=True)  # (a member left the epoch: the others' calls with it cannot complete)
        elif ready and not self.stop and self.store.check([m.key("up", self.epoch, i) for i in survivors]):
            self._want()  # (a newcomer waits until the current group is open: its barrier must not be cut)
        if self.want is None:
            return
        late = [i for i in survivors if i not in arrived]
        if any(i not in self.beats.frozen for i in late) and time.time() - self.want < self.ctimeout:
            self._say_waiting(late)
            return
        for i in late:  # frozen, or alive but silent past the time-out: dropped; if it comes back, refused (_admit)
            self.lost[i], self.dropped[i] = time.time(), nxt
            self.why[i] = "frozen: no heartbeat" if i in self.beats.frozen else "silent past --collective-timeout"
        stateless = [i for i, r in arrived.items() if r["live"] is None and r["snap"] is None]  # a failed heal
        offers = {i: r for i, r in arrived.items() if i not in stateless}
        if not offers:
            raise TrainingError(f"elastic: no rank with the training state is left (lost: {sorted(self.lost)})")
        source, sharded = "peers", any("pieces" in r for r in offers.values())
        if sharded:  # every piece must be at hand, from its holder or a replica; every survivor stays
            target, source = sharded_target(offers)
        else:
            target = replicated_target(offers)
        # (whole replicas: a survivor a step behind gets that step's state from one that holds it)
        whole = not sharded and all(r.get("whole") for r in offers.values())
        keep = [i for i in survivors if i in offers and (sharded or whole or target in reachable(offers[i]))]
        if self.grid != (1, 1):  # a replica with a rank missing is out whole (its live ranks are ended below)
            keep = whole_replicas(self.members, keep, *self.grid)
        if self.servers:  # a server's shard has no copy: its loss ends the job
            gone = [i for i in self.members[-self.servers:] if i not in keep]
            if gone:
                raise TrainingError(f"elastic: parameter server rank id(s) {gone} lost; a server's shard of the "
                                    f"weights and optimizer has no copy, so ps-sync survives the loss of workers "
                                    f"only, and the job ends")
        joiners = (stateless + ready)[:max(0, self.hi - len(keep))]
        starting = [i for i in self.waiting if i not in ready]
        if len(keep) + len(joiners) < self.lo and starting and time.time() - self.want < self.ctimeout + 120:
            return  # below MIN, but a replacement is on its way: wait for it
        left = [i for i in self.members if i not in keep and i not in stateless]
        for i in left:
            if i not in self.dropped:  # (a dropped one is refused if it comes back)
                self._kill(i)
        order = keep + joiners if not self.servers else \
            keep[:-self.servers] + joiners + keep[-self.servers:]  # (ps: the servers stay last)
        info = {"ids": order, "step": target, "old": len(self.members), "left": left, "joined": joiners,
                "rolled_back": rolled_back(target, [offers[i] for i in keep], sharded), "source": source,
                "rolled_forward": None if sharded else next((target - 1 for i in keep if offers[i]["live"] == target - 1),
                                                            None),
                "t0": min([self.want, *(self.lost.get(i, self.want) for i in left)]),
                "spawned": {str(i): self.started[i] for i in joiners}}
        if len(keep) + len(joiners) < self.lo:
            why = f"rank id(s) {', '.join(map(str, left))} lost" if left else "ranks lost"
            self.stop = info["stop"] = (f"elastic: stopped at step {target}: {len(keep)} rank(s) left ({why}), fewer "
                                        f"than MIN {self.lo} of --elastic {self.lo}:{self.hi}")
            info.update(ids=keep, joined=[])
            joiners = []
        # who gets the state over the new group, and from whom: newcomers, and (replicated state) survivors a
        # step behind the one the group goes on from; the first member that holds it sends it
        behind = [] if sharded else [i for i in keep if target not in reachable(offers[i])]
        holder = next((i for i in info["ids"] if i not in behind and i not in joiners), None)
        info.update(receive=behind + joiners, sender=info["ids"].index(holder) if holder is not None else 0)
        self.epoch, self.members, self.want = nxt, info["ids"], None
        self.beats.new_epoch()
        self.store.set(m.key("members", nxt), json.dumps(info))
        for i in joiners:
            self.waiting.pop(i, None)
            self.store.set(m.key("invite", i), str(nxt))
            self.store.add(m.key("joins"), 1)
        self.events.append(info)
        self._say_change(info)

    def _say_change(self, info: dict) -> None:
        """The change's one console line: who left and why, who joined, the world now, the step the group goes
        on from (rolled back: the step under way is redone). On a line of its own: a progress bar that rank 0
        draws on the same terminal is cleared first (its next update draws it again below)."""
        ended = "ended: its model replica lost a rank, or it cannot reach the step"
        parts = [f"rank id {i} left ({self.why.get(i, ended)})" for i in info["left"]]
        parts += [f"rank id {i} joined" for i in info["joined"]]
        world = f"world {info['old']} -> {len(info['ids'])}"
        if info.get("stop"):
            then = f"fewer than MIN {self.lo} of --elastic {self.lo}:{self.hi}: the job stops"
        elif info["rolled_back"] is not None:
            then = f"rolled back to step {info['rolled_back']} (the step under way is redone)"
        else:
            then = f"goes on from step {info['step']}"
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")
            sys.stderr.flush()
        print(f"distrain: elastic: {', '.join(parts) or 'membership changed'}; {world}; {then}", flush=True)

    def _watch_beats(self) -> None:
        """A member frozen (beats.Beats: no heartbeat for FROZEN_S once the group opened) while the group runs is
        a loss: the epoch ends (its blocked calls break, member.py), and the member is dropped when the others
        have arrived."""
        new = self.beats.watch(self.store, self.epoch, self.members, self.lost.keys() | self.gone)
        if new:
            print(f"distrain: elastic: rank id(s) {', '.join(map(str, new))} frozen (no heartbeat for {m.FROZEN_S:g}s in "
                  f"epoch {self.epoch}): the group goes on without {'it' if len(new) == 1 else 'them'}", flush=True)
            self._want(lost=True)

    def _say_waiting(self, late: list[int]) -> None:
        """One line, once per change, when members keep the others waiting for SAY_S: whom, doing what."""
        if self.said == self.epoch or time.time() - self.want < SAY_S:
            return
        self.said = self.epoch
        what = "; ".join(f"rank id {i} {self.beats.doing(i)}" for i in late)
        print(f"distrain: elastic: epoch {self.epoch} ended {time.time() - self.want:.0f}s ago; waiting for "
              f"{what} to leave it (at most --collective-timeout {self.ctimeout:g}s)", flush=True)

    def _group_step(self) -> int | None:
        """The group's step: the one rank 0 last started (``step``: every step before it is done), else the
        last membership's."""
        if self.store.check([m.key("step")]):
            return int(self.store.get(m.key("step")))
        return json.loads(self.store.get(m.key("members", self.epoch)))["step"]

    def _refuse(self, ident: int, offer: dict, epoch: int) -> None:
        self.dropped.setdefault(ident, epoch)
        why = self.refused[ident] = refusal(ident, offer, self.run_id, self._group_step(), ident in self.beats.frozen)
        self.store.set(m.key("refuse", ident), why)
        print(f"distrain: {why}", flush=True)

    def _admit(self) -> None:
        """A dropped member that comes back (it arrives for the epoch it was left out of) is refused."""
        for i, epoch in self.dropped.items():
            if i not in self.refused and i not in self.gone and self.store.check([m.key("arrive", epoch, i)]):
                self._refuse(i, json.loads(self.store.get(m.key("arrive", epoch, i))), epoch)

    def _replace(self) -> None:
        alive = [i for i in self.members if i not in self.lost]
        if self.stop or self.replace <= 0 or len(alive) + len(self.waiting) >= self.hi:
            return
        self.replace -= 1
        ident, self.next_id = self.next_id, self.next_id + 1
        self.waiting[ident] = time.time()
        self._start(ident, newcomer=True)

    # -- the whole job ------------------------------------------------------------------------
    def run(self) -> dict[int, Any]:
        if self.nodes is None:  # the loopback's, sealed with a secret of this job (other users reach the port only)
            secret = sealed.new()
            self.store = sealed.SealedStore(local_store(self.hi + 1, self.ctimeout), secret.encode())
        else:  # node 0 of several: the store on its address, the other nodes' ranks reported by their agents
            secret = self.nodes.secret
            self.store = multinode.serve_store(self.nodes, self.hi + self.nodes.nodes, self.ctimeout)
            self.remote = multinode.Remote(self.nodes, self.nproc)
        self.store.set(m.key("run"), self.run_id)  # (node agents give their ranks this run's id)
        if self.nodes is None and self.bind_cores is not False:  # (None: when MAX cores are free right now)
            self.slices = core_slices(self.hi) if self.bind_cores else free_core_slices(self.hi)
            if self.bind_cores and self.slices is None:
                raise ConfigError(f"elastic: bind_cores=True needs a core per rank, but MAX {self.hi} ranks share "
                                  f"{len(os.sched_getaffinity(0))} core(s); pass bind_cores=None or False")
        self.recipe = Recipe(self.fn, self.args, self.backend, self.ctimeout, self.store.port, self.run_id,
                             host=self.nodes.host if self.nodes else "127.0.0.1",
                             stride=self.nproc // self.nodes.nodes if self.nodes else 1,
                             threads=len(self.slices[0]) if self.slices else
                             threads_per_rank(self.hi, self.nodes.nodes if self.nodes else 1), secret=secret)
        self.store.set(m.key("members", 0), json.dumps({"ids": self.members, "step": None, "old": self.nproc,
                                                          "left": [], "joined": [], "t0": time.time()}))
        for i in self.members if self.nodes is None else self.nodes.ids(self.nproc):
            self._start(i, newcomer=False)
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        done = False
        try:
            while True:
                self._poll()
                if self.remote is not None:
                    for o in self.remote.poll(self.store, self.gone):
                        self.fold(o)
                if self.failures:
                    self._grace()
                    raise blame(self.failures)
                if all(i in self.results for i in self.members):
                    done = True
                    return {i: self.results[i] for i in self.members}
                if any(i in self.gone and i not in self.results and i not in self.lost for i in self.members):
                    raise TrainingError("elastic: a member ended without a result")
                self._replace()
                self._admit()
                self._watch_beats()
                if self.news.any(self.store, steady=self.want is None and not self.waiting and not self.dropped):
                    self._step_membership()
                if deadline is not None and time.monotonic() > deadline:
                    running = [i for i in self.sup.procs if i not in self.gone]
                    raise SpawnTimeoutError(f"elastic: timed out after {self.timeout:g}s (the whole-run limit); "
                                            f"rank id(s) {running} still running (raise --timeout)")
        finally:
            if self.remote is not None:
                multinode.end_nodes(self.store)
            if done:  # the ranks sent their results and are leaving: let them finish (their files, semaphores)
                self.sup.join(10, [i for i in self.results if i in self.sup.procs])
            for i in self.sup.procs:
                self.sup.kill(i)
            self.sup.close()

    def _grace(self) -> None:
        """After a rank failed in its own code, listen a moment so the first failure is blamed."""
        end = time.monotonic() + 1.0
        while time.monotonic() < end and len(self.gone) < len(self.sup.procs):
            self._poll()
            if self.remote is not None:
                for o in self.remote.poll(self.store, self.gone):
                    self.fold(o)


def signal_name(signum: int) -> str:
    """``SIGKILL`` for 9 (``signal 64`` for a number with no name)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def run(fn: Callable[..., Any], nproc: int, lo: int, hi: int, args: Sequence = (), replace: int = 0,
        backend: str = "gloo", timeout: float | None = None, collective_timeout: float = 300.0,
        preload: Sequence[str] = (), grid: tuple[int, int] = (1, 1), nodes=None,
        servers: int = 0, bind_cores: bool | None = False) -> tuple[dict[int, Any], str | None, list[dict]]:
    """Run an elastic job (see the module docstring); returns (results by id, the stop reason or
    None, the membership decisions). ``grid`` = (tp, pp): ranks go by whole model replicas.
    ``nodes`` (nodes.NodeSpec): this is one node of several; node 0 coordinates, the others run
    their ranks (nodes.run_node) and return ({}, None, []). ``bind_cores`` (one host): as distrain.spawn's, over
    MAX ranks (None: bind when MAX cores are free at the start; a newcomer takes the cores of a rank gone)."""
    if nodes is not None and nodes.node > 0:  # a node agent: it starts and reports its ranks, decides nothing
        code = multinode.run_node(nodes, nproc, fn, args, backend, collective_timeout, preload, hi)
        if code:
            raise TrainingError(f"elastic: node {nodes.node} lost the coordinator (node 0); its ranks were ended")
        return {}, None, []
    coord = Coordinator(fn, args, nproc, lo, hi, replace, backend, timeout, collective_timeout, preload, grid, nodes,
                        servers, bind_cores)
    results = coord.run()
    return results, coord.stop, coord.events
