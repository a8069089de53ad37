"""``distrain cluster run``: start one command on every node of an emulated cluster.

On node i (inside netns NAME-i) this runs ``distrain launch --nproc-per-node K --nnodes N
--node-rank i --rdzv-endpoint 10.251.0.1:29400 --rdzv-id distrain-cluster -- -m distrain.cluster.command`` (torch's
elastic agent, c10d rendezvous hosted by node 0), whose ranks run CMD (see
:mod:`distrain.cluster.command`), so every rank gets the launcher's environment (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...) and ``distrain train``/``distrain bench comm``
run across the nodes unchanged. Per node the environment also carries:

* ``DISTRAIN_JOB_SECRET``: the job's secret, the same on every node (yours when set, else a new
  one): the job's stores are sealed with it (distrain.sealed);
* ``GLOO_SOCKET_IFNAME=eth0``: Gloo's traffic between nodes takes the shaped link;
* ``PET_LOCAL_ADDR`` = the node's address and ``PET_RDZV_CONF=is_host=1|0``: torchrun
  would otherwise look the node up by the host name, which all namespaces share;
* ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the ranks of every rendezvous round get a new
  store, hosted by rank 0 (torch's default shares the agent's store across rounds and
  tells attempts apart by the restart count, which each node's agent keeps for itself
  (pytorch/pytorch#108158): after a rank failed on one node, the restarted ranks waited for
  each other until their time-out);
* ``OMP_NUM_THREADS`` = this host's cores // all ranks of the cluster (at least 1), unless
  already set: the emulated nodes share the host's cores, and torch's default (one thread
  per core in every rank) oversubscribes them, which makes OpenMP regions wait on
  descheduled threads (measured here, 2 cores under load: a gpt-small forward+backward at
  batch 16 took 2.8 s with 2 threads and 0.2 s with 1).

Failure: the first node whose launcher exits non-zero (or is killed) is named, with its
exit status; the others get ``grace`` seconds to notice (their ranks' Gloo sockets break)
and are then ended. Whatever happens, every process left in the cluster's namespaces is
ended before returning (``netns.kill_all``); the node launchers also die with this process
(``PR_SET_PDEATHSIG``), so a crash of ``cluster run`` does not leave them behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from distrain.cluster import netns
from distrain.errors import ConfigError

RDZV_PORT = 29400
CMD_ENV = "DISTRAIN_CLUSTER_CMD"  # the command, as JSON, read by distrain.cluster.command
ELASTIC_NODES_ENV = "DISTRAIN_ELASTIC_NODES"  # NODE/NODES@HOST:PORT of an elastic job (distrain.elastic.nodes)


@dataclass
class NodeExit:
    node: int
    code: int
    at: float  # seconds after start

    def describe(self) -> str:
        if self.code < 0:
            return f"killed by signal {-self.code} ({signal.Signals(-self.code).name})"
        return f"exit code {self.code}"


@dataclass
class RunResult:
    exits: list[NodeExit]
    output: list[str] = field(default_factory=list)  # "[node i] line" lines, in arrival order
    elastic: bool = False  # an elastic job: its outcome is node 0's (the others may be lost on the way)

    @property
    def returncode(self) -> int:
        if self.elastic:
            return 0 if self.exits[0].code == 0 else 1
        return 0 if all(e.code == 0 for e in self.exits) else 1

    @property
    def first_failure(self) -> NodeExit | None:
        bad = [e for e in self.exits if e.code != 0]
        return min(bad, key=lambda e: e.at) if bad else None


def check_command(cmd: list[str]) -> list[str]:
    """The command as given (``distrain ...``, ``[python] script.py ...``, ``python -m mod ...`` or a program)."""
    if not cmd:
        raise ConfigError("cluster run: give the command after --, e.g. `distrain cluster run -- distrain train --nproc 4`")
    head = os.path.basename(cmd[0])
    if head.startswith("python") and len(cmd) < 2:
        raise ConfigError(f"cluster run: {cmd[0]} needs a script or -m MODULE")
    return list(cmd)


def elastic_command(cmd: list[str], nproc: int) -> list[str] | None:
    """The arguments after ``distrain`` of an elastic ``distrain train`` (``--nproc`` added: every node's
    ranks), or None for any other command (run under torchrun)."""
    if os.path.basename(cmd[0]) != "distrain" or cmd[1:2] != ["train"] or not any(
            a == "--elastic" or a.startswith("--elastic=") for a in cmd):
        return None
    if not any(a == "--nproc" or a.startswith("--nproc=") for a in cmd):
        return [*cmd[1:], "--nproc", str(nproc)]
    return cmd[1:]


def node_env(spec: netns.ClusterSpec, i: int, cmd: list[str], procs_per_node: int = 1) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
    env.setdefault("OMP_NUM_THREADS", str(rank_threads(spec.nodes * procs_per_node)))
    env.update({"GLOO_SOCKET_IFNAME": "eth0", "PET_LOCAL_ADDR": spec.address(i),
                "PET_RDZV_CONF": f"is_host={1 if i == 0 else 0}", "DISTRAIN_CLUSTER_NODE": str(i),
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
                CMD_ENV: json.dumps(cmd)})
    return env


def rank_threads(ranks: int) -> int:
    """Threads per rank when ``ranks`` ranks share this host's cores (at least 1)."""
    return max(1, (os.cpu_count() or 1) // ranks)


def _die_with_parent() -> None:  # runs in the child between fork and exec
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _pump(i: int, stream, sink: list[str], echo: bool, lock: threading.Lock) -> None:
    for line in stream:
        line = f"[node {i}] {line.rstrip()}"
        with lock:
            sink.append(line)
            if echo:
                print(line, flush=True)


def run(spec: netns.ClusterSpec, cmd: list[str], procs_per_node: int = 1, max_restarts: int = 0,
        timeout: float = 3600.0, grace: float = 60.0, echo: bool = True) -> RunResult:
    """Run ``cmd`` on every node (``procs_per_node`` ranks each); see the module docstring."""
    if procs_per_node < 1:
        raise ConfigError(f"--procs-per-node must be >= 1, got {procs_per_node}")
    from distrain import sealed  # (torch: imported by a run only, so that `cluster up|down|status|link` need none)

    cmd = check_command(list(cmd))
    endpoint = f"{spec.address(0)}:{RDZV_PORT}"
    secret = sealed.check(os.environ[sealed.ENV]).decode() if os.environ.get(sealed.ENV) else sealed.new()
    procs, pumps, out, lock = [], [], [], threading.Lock()
    t0 = time.monotonic()
    try:
        elastic = elastic_command(cmd, spec.nodes * procs_per_node)
        for i in range(spec.nodes):
            env = node_env(spec, i, cmd, procs_per_node) | {sealed.ENV: secret}  # (one job: one secret on every node)
            if elastic is None:
                argv = ["ip", "netns", "exec", spec.netns(i), sys.executable, "-m", "distrain", "launch",
                        "--nproc-per-node", str(procs_per_node), "--nnodes", str(spec.nodes), "--node-rank", str(i),
                        "--rdzv-endpoint", endpoint, "--max-restarts", str(max_restarts),
                        "--rdzv-id", "distrain-cluster", "--", "-m", "distrain.cluster.command"]
            else:  # `distrain train --elastic`: its own agents, not torchrun (distrain/elastic/nodes.py)
                argv = ["ip", "netns", "exec", spec.netns(i), sys.executable, "-m", "distrain", *elastic]
                env[ELASTIC_NODES_ENV] = f"{i}/{spec.nodes}@{endpoint}"
            p = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, preexec_fn=_die_with_parent)
            procs.append(p)
            th = threading.Thread(target=_pump, args=(i, p.stdout, out, echo, lock), daemon=True)
            th.start()
            pumps.append(th)
        exits = _wait(procs, t0, timeout, grace, leader=elastic is not None)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        netns.kill_all(spec.name, switch=False)  # the switch's delay lines stay with the cluster
        for p in procs:
            p.wait()
        for th in pumps:
            th.join(5)
    return RunResult(exits, out, elastic=elastic is not None)


def _wait(procs, t0: float, timeout: float, grace: float, leader: bool = False) -> list[NodeExit]:
    """Every node's exit; the others get ``grace`` seconds after the first failure (``leader``: after
    node 0 ends, an elastic job's coordinator, which goes on when other nodes are lost)."""
    exits: dict[int, NodeExit] = {}
    deadline = t0 + timeout
    while len(exits) < len(procs):
        now = time.monotonic()
        for i, p in enumerate(procs):
            if i not in exits and p.poll() is not None:
                exits[i] = NodeExit(i, p.returncode, now - t0)
        ended = [e for e in exits.values() if (e.node == 0 if leader else e.code != 0)]
        if ended:
            deadline = min(deadline, min(e.at for e in ended) + t0 + grace)
        if now > deadline:
            for i, p in enumerate(procs):
                if i not in exits:
                    p.kill()
                    p.wait()
                    exits[i] = NodeExit(i, -signal.SIGKILL, time.monotonic() - t0)
            break
        time.sleep(0.05)
    return [exits[i] for i in range(len(procs))]
