"""The worker side of the parameter server: :class:`PSWorker` pulls weights into the local model
and pushes its gradients, one message per server (protocol: ps_protocol.py; server: ps.py). With
``fixed_point=True`` (sync only, --layout-invariant) a push is the worker's int64 gradient sums and
their exponents (:meth:`PSWorker.push_fixed`) instead of its float gradients.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from distrain import comm
from distrain.errors import ConfigError
from distrain.parallel.parameter_server.ps_layout import PSLayout
from distrain.parallel.parameter_server.ps_protocol import (
    I64,
    MAGIC,
    TAG_HELLO,
    TAG_PULL,
    TAG_PUSH,
    TAG_PUSH_HDR,
    TAG_REQ,
    TAG_VERSION,
    check_setup,
    describe_mode_word,
    mode_word,
    over_transport,
)

__all__ = ["PSWorker"]


class PSWorker:
    """One worker rank: ``pull()`` weights into the local model, ``push()`` its gradients (or, with
    ``fixed_point``, ``push_fixed(...)`` its int64 gradient sums)."""

    def __init__(self, model: nn.Module, layout: PSLayout, mode: str = "sync", fixed_point: bool = False):
        self.rank, self.params = check_setup("PSWorker", model, layout, mode, want_server=False)
        if fixed_point and mode != "sync":
            raise ConfigError("PSWorker: fixed-point pushes are for mode 'sync' (a step's sums over all workers)")
        self.layout, self.mode, self.fixed_point = layout, mode, fixed_point
        S = layout.num_servers
        self._slices = [layout.slices(s) for s in range(S)]
        p0 = self.params[0]
        self._wbuf = [torch.empty(layout.shard_numel(s), dtype=p0.dtype, device=p0.device) for s in range(S)]
        if fixed_point:  # per server: its elements' int64 sums, then [exponent, non-finite] per parameter
            self._gbuf = [torch.empty(layout.push_numel(s, True), dtype=I64) for s in range(S)]
            self._offsets = [sum(layout.numels[:i]) for i in range(len(self.params))]  # model order
        else:
            self._gbuf = [torch.empty_like(b) for b in self._wbuf]
        self._src = [layout.server_rank(s) for s in range(S)]
        self.versions = [0] * S  # per server: the version of the last pull
        self.step = 0  # pushes done
        self.bounded: bool | None = None  # some server bounds staleness (learnt from the hellos)
        self._pulled = False
        self.pull_s = self.push_s = 0.0
        self._me = f"worker rank {self.rank}"

    def _peer(self, s: int) -> str:
        return f"parameter server rank {self._src[s]}"

    def _hello(self) -> None:
        L, self.bounded = self.layout, False
        for s in range(L.num_servers):
            h = torch.empty(7, dtype=I64)
            over_transport(self._me, self._peer(s), "the hello",
                           lambda: comm.recv(h, self._src[s], tag=TAG_HELLO, label="ps_ctrl"))
            got = h.tolist()
            want = [MAGIC, mode_word(self.mode, self.fixed_point), L.num_servers, L.num_workers, s, L.shard_numel(s)]
            if got[:6] != want:
                raise ConfigError(
                    f"{self._me}: {self._peer(s)} disagrees on the set-up: it serves mode "
                    f"{describe_mode_word(got[1])}, {got[2]} servers, {got[3]} workers, shard {got[4]} of {got[5]} "
                    f"elements; this worker expects mode {describe_mode_word(want[1])}, {want[2]} servers, "
                    f"{want[3]} workers, shard {s} of {want[5]} elements")
            self.bounded = self.bounded or got[6] >= 0

    def pull(self) -> None:
        """Receive the current weights of every parameter (one message per server) into the model."""
        if self._pulled:
            raise ConfigError(f"PSWorker.pull: rank {self.rank} pulled twice without push(); each step is "
                              f"pull(), forward/backward, push() (and one final pull())")
        t0 = time.perf_counter()
        if self.bounded is None:
            self._hello()
        what, S = f"pull of step {self.step}", self.layout.num_servers
        pending = []
        for s in range(S):
            pending.append(self._ask(s, what))
            if self.bounded:  # a bounded server may hold the answer back: one server at a time, in order
                self._wait(*pending.pop(), what)
        for p in pending:
            self._wait(*p, what)
        with torch.no_grad():
            for s in range(S):
                for i, a, b in self._slices[s]:
                    self.params[i].copy_(self._wbuf[s][a:b].view_as(self.params[i]))
        self._pulled = True
        self.pull_s += time.perf_counter() - t0

    def _ask(self, s: int, what: str) -> tuple:
        """Post the receives of server s's answer (async: [version] first) and, async, send the request."""
        src, ver = self._src[s], torch.zeros(1, dtype=I64)
        msgs = [(comm.irecv, self._wbuf[s], TAG_PULL, "ps_pull")]
        if self.mode == "async":
            msgs = [(comm.irecv, ver, TAG_VERSION, "ps_ctrl"), *msgs,
                    (comm.isend, torch.tensor([self.step], dtype=I64), TAG_REQ, "ps_ctrl")]
        hs = [over_transport(self._me, self._peer(s), what, lambda: op(t, src, tag=tag, label=label))
              for op, t, tag, label in msgs]
        return s, hs, ver

    def _wait(self, s: int, handles: list, ver: torch.Tensor, what: str) -> None:
        for h in handles:
            over_transport(self._me, self._peer(s), what, h.wait)
        self.versions[s] = int(ver[0])

    def push(self, zero_grad: bool = True) -> None:
        """Send this step's gradients (one message per server; a parameter without one sends zeros),
        then set them to None if ``zero_grad``."""
        if self.fixed_point:
            raise ConfigError(f"PSWorker.push: rank {self.rank} pushes fixed-point sums: call push_fixed(...)")
        t0 = self._check_pushable("push")
        with torch.no_grad():
            for s in range(self.layout.num_servers):
                for i, a, b in self._slices[s]:
                    g = self.params[i].grad
                    if g is None:
                        self._gbuf[s][a:b].zero_()
                    else:
                        self._gbuf[s][a:b].copy_(g.reshape(-1))
        self._send(t0, zero_grad)

    def push_fixed(self, integers: torch.Tensor, exponents: list[int], nonfinite: list[bool]) -> None:
        """Fixed-point mode: send this step's int64 gradient sums (``integers``: every parameter's, flat
        in model order; FixedPointGradients' accumulator over the whole model) with each parameter's
        exponent and whether its gradient was not finite (the same on every worker), then set the
        gradients to None. The server adds the workers' integers and converts them back once."""
        if not self.fixed_point:
            raise ConfigError(f"PSWorker.push_fixed: rank {self.rank} was built for float pushes (fixed_point=False)")
        t0 = self._check_pushable("push_fixed")
        n = len(self.params)
        if integers.dtype != I64 or integers.numel() < sum(self.layout.numels) or len(exponents) != n \
                or len(nonfinite) != n:
            raise ConfigError(f"PSWorker.push_fixed: want int64 sums of {sum(self.layout.numels)} elements and "
                              f"{n} exponents and flags, got {integers.dtype} {integers.numel()}, {len(exponents)}, "
                              f"{len(nonfinite)}")
        for s in range(self.layout.num_servers):
            buf, sl = self._gbuf[s], self._slices[s]
            head = buf[self.layout.shard_numel(s):].view(-1, 2)  # (parameters of the shard, 2)
            for i, a, b in sl:
                buf[a:b].copy_(integers[self._offsets[i]:self._offsets[i] + b - a])
            head.copy_(torch.tensor([[exponents[i], int(bool(nonfinite[i]))] for i, _, _ in sl], dtype=I64))
        self._send(t0, True)

    def _check_pushable(self, name: str) -> float:
        if not self._pulled:
            raise ConfigError(f"PSWorker.{name}: rank {self.rank} pushed without a pull(); each step is "
                              f"pull(), forward/backward, push()")
        return time.perf_counter()

    def _send(self, t0: float, zero_grad: bool) -> None:
        """Send the filled push buffers (one message per server), then close the step."""
        what, hs = f"push of step {self.step}", []
        for s, dst in enumerate(self._src):
            msgs = [(self._gbuf[s], TAG_PUSH, "ps_push")]
            if self.mode == "async":
                msgs.insert(0, (torch.tensor([self.step, self.versions[s]], dtype=I64), TAG_PUSH_HDR, "ps_ctrl"))
            hs += [(s, over_transport(self._me, self._peer(s), what, lambda: comm.isend(t, dst, tag=tag, label=label)))
                   for t, tag, label in msgs]
        for s, h in hs:
            over_transport(self._me, self._peer(s), what, h.wait)
        if zero_grad:
            for p in self.params:
                p.grad = None
        self.step += 1
        self._pulled = False
        self.push_s += time.perf_counter() - t0

    def stats(self) -> dict:
        return {"role": "worker", "rank": self.rank, "mode": self.mode, "pushes": self.step,
                "versions": list(self.versions), "pull_s": self.pull_s, "push_s": self.push_s}
