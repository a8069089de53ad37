"""Roles and shards of a parameter-server job: pure functions of sizes, no processes.

:class:`PSLayout` answers, for a world of ``world_size`` ranks and ``S`` servers:

* who is who: the servers are the **last** S ranks (``W .. world_size-1``), the workers the
  first ``W = world_size - S`` (so rank 0 is always a worker and can report metrics);
* which server owns which parameter: parameters (in ``model.parameters()`` order) are
  balanced by **bytes**, greedily: the largest parameter first onto the least-loaded
  server (ties: larger parameter first, then lower parameter index; among equally loaded
  servers the one holding fewer parameters, then the lower server index). A parameter is
  never split, so S may not exceed the number of parameters. Inside a shard parameters keep
  model order: the flat message of server s is the concatenation of its parameters, in
  model order.

:func:`expected_ps_bytes` gives the exact ledger counts of the data messages ("ps_pull":
weights, "ps_push": gradients), per rank, for a number of steps. Per step, with N the
model's parameter bytes and N_s the bytes of server s's shard (sum_s N_s = N):

* server s sends W*N_s ("ps_pull") and receives W*N_s ("ps_push");
* every worker receives N ("ps_pull", S messages) and sends N ("ps_push", S messages).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch.nn as nn

from distrain.comm.core.util import check_int
from distrain.errors import ConfigError


def _positive_int(name: str, v, minimum: int) -> int:
    return check_int(v, name, "PSLayout", minimum)


class PSLayout:
    """Ranks and parameter shards of a parameter-server job (same result on every rank).

    ``sizes``: one entry per parameter, a shape (tuple/list/torch.Size) or a numel (int);
    ``element_sizes``: bytes per element, one int for all parameters or one per parameter;
    ``names``: optional parameter names for messages and :meth:`describe`.
    """

    def __init__(self, world_size: int, num_servers: int, sizes: Sequence, element_sizes: int | Sequence[int] = 4,
                 names: Sequence[str] | None = None):
        world_size = _positive_int("world_size", world_size, 1)
        if isinstance(num_servers, bool) or not isinstance(num_servers, int) or num_servers < 1:
            raise ConfigError(f"PSLayout: the number of servers must be an int >= 1, got {num_servers!r} "
                              f"(a parameter-server job needs at least one server)")
        if world_size - num_servers < 1:
            raise ConfigError(
                f"nproc {world_size} is too small for {num_servers} server{'s' if num_servers > 1 else ''}: need at "
                f"least {num_servers + 1} processes (S servers + at least 1 worker)")
        sizes = list(sizes)
        if not sizes:
            raise ConfigError("PSLayout: the model has no parameters to serve")
        numels = []
        for i, s in enumerate(sizes):
            if isinstance(s, int) and not isinstance(s, bool):
                n = s
            elif isinstance(s, (tuple, list)) or type(s).__name__ == "Size":
                if any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in s):
                    raise ConfigError(f"PSLayout: parameter {i} has an invalid shape {tuple(s)!r}")
                n = math.prod(s)
            else:
                raise ConfigError(f"PSLayout: parameter {i}: expected a shape or a numel, got {s!r}")
            if n < 1:
                raise ConfigError(f"PSLayout: parameter {i} ({names[i] if names else 'unnamed'}) has no elements; "
                                  f"empty parameters cannot be served")
            numels.append(n)
        P = len(numels)
        if isinstance(element_sizes, int) and not isinstance(element_sizes, bool):
            element_sizes = [element_sizes] * P
        element_sizes = list(element_sizes)
        if len(element_sizes) != P or any(isinstance(e, bool) or not isinstance(e, int) or e < 1
                                          for e in element_sizes):
            raise ConfigError(f"PSLayout: element_sizes must be one positive int or one per parameter ({P}), "
                              f"got {element_sizes!r}")
        if names is not None and len(names) != P:
            raise ConfigError(f"PSLayout: {len(names)} names for {P} parameters")
        if num_servers > P:
            raise ConfigError(
                f"PSLayout: {num_servers} servers but the model has only {P} parameter tensors; a parameter is never "
                f"split across servers, so use at most {P} servers")

        self.world_size = world_size
        self.num_servers = num_servers
        self.num_workers = world_size - num_servers
        self.numels: tuple[int, ...] = tuple(numels)
        self.element_sizes: tuple[int, ...] = tuple(element_sizes)
        self.nbytes: tuple[int, ...] = tuple(n * e for n, e in zip(numels, element_sizes))
        self.names: tuple[str, ...] = tuple(names) if names is not None else tuple(f"param{i}" for i in range(P))
        self.shapes: tuple[tuple[int, ...], ...] = tuple(
            tuple(s) if not isinstance(s, int) else (s,) for s in sizes)

        # Greedy balancing by bytes (largest first onto the least-loaded server).
        load, count = [0] * num_servers, [0] * num_servers
        owner = [0] * P
        for i in sorted(range(P), key=lambda i: (-self.nbytes[i], i)):
            s = min(range(num_servers), key=lambda s: (load[s], count[s], s))
            owner[i] = s
            load[s] += self.nbytes[i]
            count[s] += 1
        self.owner: tuple[int, ...] = tuple(owner)
        self._params_of = [[i for i in range(P) if owner[i] == s] for s in range(num_servers)]

    @classmethod
    def from_model(cls, model: nn.Module, world_size: int, num_servers: int) -> "PSLayout":
        """The layout of ``model.parameters()`` (shapes, element sizes and names)."""
        named = list(model.named_parameters())
        return cls(world_size, num_servers, [tuple(p.shape) for _, p in named],
                   [p.element_size() for _, p in named], [n for n, _ in named])

    # -- roles ---------------------------------------------------------------------------
    @property
    def workers(self) -> list[int]:
        return list(range(self.num_workers))

    @property
    def servers(self) -> list[int]:
        return list(range(self.num_workers, self.world_size))

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ConfigError(f"PSLayout: rank {rank!r} is outside [0, {self.world_size})")
        return rank

    def is_server(self, rank: int) -> bool:
        return self._check_rank(rank) >= self.num_workers

    def role(self, rank: int) -> str:
        """``"server"`` or ``"worker"``."""
        return "server" if self.is_server(rank) else "worker"

    def server_rank(self, s: int) -> int:
        """Global rank of server index ``s`` (0..S-1)."""
        if not 0 <= s < self.num_servers:
            raise ConfigError(f"PSLayout: server index {s} is outside [0, {self.num_servers})")
        return self.num_workers + s

    def server_index(self, rank: int) -> int:
        """Server index (0..S-1) of a server rank."""
        if not self.is_server(rank):
            raise ConfigError(f"PSLayout: rank {rank} is a worker (servers are ranks {self.servers})")
        return rank - self.num_workers

    # -- shards --------------------------------------------------------------------------
    def params_of(self, s: int) -> list[int]:
        """Indices (in model order) of the parameters server index ``s`` owns."""
        self.server_rank(s)
        return list(self._params_of[s])

    def slices(self, s: int) -> list[tuple[int, int, int]]:
        """``(parameter index, start, end)`` of each parameter in server s's flat message (elements)."""
        out, off = [], 0
        for i in self.params_of(s):
            out.append((i, off, off + self.numels[i]))
            off += self.numels[i]
        return out

    def check_model(self, model: nn.Module, who: str = "PSLayout") -> list[nn.Parameter]:
        """``model.parameters()`` if they match this layout and can be served (ConfigError otherwise)."""
        params = list(model.parameters())
        if [tuple(p.shape) for p in params] != list(self.shapes) or \
                [p.element_size() for p in params] != list(self.element_sizes):
            raise ConfigError(f"{who}: the model's parameters do not match the layout (shapes or element sizes "
                              f"differ); build the layout with PSLayout.from_model(model, ...) from the same model")
        if len({p.dtype for p in params}) != 1:
            raise ConfigError(f"{who}: all parameters must share one dtype (one flat message per server), "
                              f"got {sorted({str(p.dtype) for p in params})}")
        frozen = [n for n, p in zip(self.names, params) if not p.requires_grad]
        if frozen:
            raise ConfigError(f"{who}: parameter(s) {frozen} do not require grad; frozen parameters are not served")
        return params

    def shard_numel(self, s: int) -> int:
        return sum(self.numels[i] for i in self.params_of(s))

    def shard_bytes(self, s: int) -> int:
        """N_s: the bytes of server s's shard (its flat message)."""
        return sum(self.nbytes[i] for i in self.params_of(s))

    def push_numel(self, s: int, fixed_point: bool = False) -> int:
        """Elements of a worker's push to server s: its shard's gradient; fixed-point (int64): the shard's
        integer sums, then an [exponent, non-finite] pair per parameter."""
        return self.shard_numel(s) + (2 * len(self.params_of(s)) if fixed_point else 0)

    def push_bytes(self, s: int, fixed_point: bool = False) -> int:
        """Bytes of a worker's push to server s: N_s, or 8 per element of the fixed-point push."""
        return 8 * self.push_numel(s, True) if fixed_point else self.shard_bytes(s)

    @property
    def total_bytes(self) -> int:
        """N: the bytes of all parameters."""
        return sum(self.nbytes)

    def describe(self) -> str:
        lines = [f"parameter servers: world {self.world_size} = {self.num_workers} workers {self.workers} "
                 f"+ {self.num_servers} servers {self.servers}; N = {self.total_bytes} bytes"]
        for s in range(self.num_servers):
            names = ", ".join(self.names[i] for i in self.params_of(s))
            lines.append(f"  server {s} (rank {self.server_rank(s)}): {self.shard_bytes(s)} bytes: {names}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"PSLayout(world_size={self.world_size}, servers={self.num_servers}, "
                f"shard_bytes={[self.shard_bytes(s) for s in range(self.num_servers)]})")


def expected_ps_bytes(layout: PSLayout, steps: int = 1, final_pull: bool = False,
                      fixed_point: bool = False) -> dict[int, dict[str, int]]:
    """Exact ledger bytes of the data messages per rank for ``steps`` steps (plus one final pull).

    Returns ``{rank: {"ps_pull_sent", "ps_pull_recv", "ps_push_sent", "ps_push_recv", "sent", "recv"}}``.
    Per step server s sends and receives W*N_s; every worker sends and receives N. Control
    messages (label "ps_ctrl", async mode only) are not included. ``fixed_point``: the pushes are
    int64 sums (``PSLayout.push_bytes``), so server s receives W*push_bytes(s) and a worker sends
    the sum of push_bytes over the servers.
    """
    steps = _positive_int("steps", steps, 0)
    pulls = steps + (1 if final_pull else 0)
    W, N = layout.num_workers, layout.total_bytes
    P = sum(layout.push_bytes(s, fixed_point) for s in range(layout.num_servers))
    out: dict[int, dict[str, int]] = {}
    for r in range(layout.world_size):
        if layout.is_server(r):
            s = layout.server_index(r)
            Ns, Ps = layout.shard_bytes(s), layout.push_bytes(s, fixed_point)
            d = {"ps_pull_sent": pulls * W * Ns, "ps_pull_recv": 0, "ps_push_sent": 0, "ps_push_recv": steps * W * Ps}
        else:
            d = {"ps_pull_sent": 0, "ps_pull_recv": pulls * N, "ps_push_sent": steps * P, "ps_push_recv": 0}
        d["sent"] = d["ps_pull_sent"] + d["ps_push_sent"]
        d["recv"] = d["ps_pull_recv"] + d["ps_push_recv"]
        out[r] = d
    return out
