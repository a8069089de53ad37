"""How an elastic rank process is started: its environment and the setup it runs first.

The coordinator (node 0) and every node agent start ranks the same way, through the launcher's one
:class:`~distrain.launch.supervisor.Supervisor`; :class:`Recipe` holds what they share (the rank
function and its arguments, the store's address, the run id, threads per rank) and
:meth:`Recipe.start` starts one identity. In the new process :class:`Enter` (the supervisor's
``setup``) makes this process's :class:`~distrain.elastic.member.Member` from that environment,
with the fault hooks of DISTRAIN_ELASTIC_FAULTS when set (elastic/faults.py), before the rank
function runs; the rank opens its process group itself (``Member.join``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

from distrain import sealed
from distrain.elastic import faults
from distrain.elastic import member as m
from distrain.elastic.protocol import env_for
from distrain.launch import local_env
from distrain.launch.supervisor import Supervisor


class Enter:
    """The setup of a rank process: install its Member (collective time-out ``timeout``)."""

    def __init__(self, backend: str, timeout: float):
        self.backend, self.timeout = backend, timeout

    def __call__(self, ident: int, report) -> None:
        m.install(m.Member.from_env(self.backend, self.timeout, hooks=faults.from_env()))


@dataclass
class Recipe:
    """What every rank of one elastic job is started with (on this node)."""

    fn: Callable[..., Any]
    args: tuple
    backend: str
    timeout: float  # the collective time-out
    port: int  # the coordinator's store
    run: str  # the run id (a rank of another run is refused)
    host: str = "127.0.0.1"
    stride: int = 1  # ranks per node: a ZeRO replica goes one node on
    threads: int = 1
    extra_env: dict = field(default_factory=dict)
    secret: str = field(default="", repr=False)  # the job's (distrain.sealed): the ranks seal the store with it

    def start(self, sup: Supervisor, ident: int, newcomer: bool, cores: list[int] | None = None) -> None:
        env = local_env() | env_for(self.port, ident, newcomer, self.run, self.host, self.stride)
        env[sealed.ENV] = self.secret
        env[faults.ENV] = os.environ.get(faults.ENV, "")  # (the fork server's environment is older than ours)
        sup.start(ident, self.fn, self.args, env=env | self.extra_env, threads=self.threads, cores=cores,
                  setup=Enter(self.backend, self.timeout), title=f"distrain rank id {ident}")  # (its rank: _open)


def threads_per_rank(hi: int, nodes: int = 1) -> int:
    """A node's cores shared by the most ranks it may run (MAX spread over the nodes)."""
    return max(1, (os.cpu_count() or 1) * nodes // hi)
