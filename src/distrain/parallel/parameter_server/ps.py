"""Parameter servers (single and sharded), synchronous and asynchronous, on distrain's P2P layer.

Roles and shards come from :class:`~distrain.parallel.parameter_server.PSLayout`: the last S ranks
are servers, the first W = world_size - S workers (rank 0 is always a worker); parameters
are balanced across servers by bytes. Server s holds only its shard, as one flat tensor of
N_s bytes (the parameters are views into it), and its own optimizer over that shard.

Contract::

    layout = PSLayout.from_model(model, world_size, S)          # the same model (seed) everywhere
    if layout.is_server(rank):
        stats = ParameterServer(model, layout, make_opt, mode, max_staleness).serve(num_steps)
    else:
        worker = PSWorker(model, layout, mode)
        for step in range(num_steps):
            worker.pull(); loss_fn(model(x), y).backward(); worker.push()   # push() zeroes grads
        worker.pull()            # the final pull (serve(final_pull=True), the default)

Every worker runs ``num_steps`` steps; modes must agree (checked by the hello). The optimizer
must act per parameter (SGD, Adam, AdamW): no global-norm clipping across shards. Buffers
are not served; parameters share one dtype and require grad.

Protocol: one tag per message kind (below 2**20), every message one flat tensor.

==============  =======  ================  =================================  =====
tag             label    direction         payload                            mode
==============  =======  ================  =================================  =====
TAG_HELLO       ps_ctrl  server -> worker  int64 [magic, mode, S, W, s, N_s, K]  both
TAG_REQ         ps_ctrl  worker -> server  int64 [step] (pull request)        async
TAG_VERSION     ps_ctrl  server -> worker  int64 [version]                    async
TAG_PULL        ps_pull  server -> worker  the shard's weights, N_s bytes     both
TAG_PUSH_HDR    ps_ctrl  worker -> server  int64 [step, version pulled]       async
TAG_PUSH        ps_push  worker -> server  the shard's gradient, N_s bytes    both
==============  =======  ================  =================================  =====

With ``fixed_point_units=U`` (sync only; the trainer's --layout-invariant) a push is int64 instead: the
worker's integer sums of its units' gradients at the step's shared exponents (distrain.parallel.invariant),
N_s / element size elements, then an [exponent, non-finite] pair per parameter of the shard (8 bytes
each: ``PSLayout.push_bytes``); the hello's mode word carries the FIXED_POINT bit. The server adds the
W workers' integers (exact, in any order), checks that their exponents agree, and converts each element
back once (``dequantize``: / 2**e / U): one process's mean gradient over the U units, bit for bit.

*Sync* (BSP). Step t on a server: post the W gradient receives, send the weights to every
worker (fan-out), wait for the gradients in worker-rank order (fan-in), sum them in that
order, divide by W, one optimizer step: exactly DDP's step on the global batch W*b.

*Async* (HogWild-style, Recht et al. 2011; Downpour SGD, Dean et al. 2012). A pull is a
request answered by [version] + weights; a push is [step, version] + gradient. The server
applies each push on arrival as one optimizer step, gradient *unscaled* (an SGD step on one
local batch of size b; W of them per round), and counts steps in ``version``. Staleness of
an applied gradient = version at apply time - version it was computed from. Gloo receives
cannot be polled (``is_completed()`` stays False until ``wait()``), so a server runs one
reader thread per worker (blocking receives, which also see a dead peer at once) feeding an
event queue; the main thread handles events in arrival order.

*Bounded staleness* ``max_staleness=K`` (SSP, Ho et al. 2013; bounded delay, Li et al. 2014)
is enforced by delaying pull answers, never by dropping gradients. With O the outstanding
gradients (pull answered, push not applied) and V the version, a pull is answered only if,
counting it, ``max over O of (V - v_g) + |O| - 1 <= K``. Applying another gradient raises V
and lowers |O| by one, so the bound holds for every gradient; a delayed pull is answered
once O drains (first come, first served). A bounded worker asks its servers one at a time
in server order (lock ordering: no cyclic wait). K = 0 serializes the workers: async PS is
then exactly sequential SGD over the local batches in ``stats["apply_order"]``. The final
pull is answered once every push is applied, so all workers end with the same weights.

Traffic per step (exact, :func:`~distrain.parallel.parameter_server.expected_ps_bytes`): server s
sends and receives W*N_s; each worker sends and receives N = sum_s N_s. One server's link
carries 2*W*N, W times a worker's (the seeds' bottleneck); S balanced servers cut it to
2*W*N/S. Ring all-reduce: 2*(P-1)*N/P each way on every rank (Patarasuk & Yuan 2009).
See docs/parameter_server.md. Failures: every transport error becomes a CommError naming
both roles ("parameter server rank 3: worker rank 1 disconnected during push of step 7: ...").

Modules: the server here; the worker in ps_worker.py (:class:`PSWorker`, re-exported here); the
tags and what both sides share in ps_protocol.py.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from typing import Callable

import torch
import torch.nn as nn

from distrain import comm
from distrain.comm.core.util import check_int
from distrain.errors import CommError, ConfigError
from distrain.parallel.invariant.fixed_point import dequantize
from distrain.parallel.parameter_server.ps_layout import PSLayout, expected_ps_bytes
from distrain.parallel.parameter_server.ps_protocol import (
    I64,
    MAGIC,
    MODES,
    TAG_HELLO,
    TAG_PULL,
    TAG_PUSH,
    TAG_PUSH_HDR,
    TAG_REQ,
    TAG_VERSION,
    ProtocolError,
    check_setup,
    mode_word,
    over_transport,
    step_name,
)
from distrain.parallel.parameter_server.ps_worker import PSWorker

__all__ = ["PSLayout", "ParameterServer", "PSWorker", "expected_ps_bytes", "MODES"]


class ParameterServer:
    """One server rank: its shard of the parameters, its optimizer, ``serve(num_steps)``.

    ``optimizer_factory(params)`` builds the optimizer over the shard's parameters;
    ``scheduler_factory(optimizer)``, if given, is stepped after every optimizer step;
    ``fixed_point_units`` (sync only): the pushes are fixed-point sums over that many units of work
    (the table above), None: float gradients.
    """

    def __init__(self, model: nn.Module, layout: PSLayout, optimizer_factory: Callable, mode: str = "sync",
                 max_staleness: int | None = None, scheduler_factory: Callable | None = None,
                 fixed_point_units: int | None = None):
        if max_staleness is not None:
            if isinstance(max_staleness, bool) or not isinstance(max_staleness, int) or max_staleness < 0:
                raise ConfigError(f"ParameterServer: max_staleness must be None or an int >= 0, got {max_staleness!r}")
            if mode == "sync":
                raise ConfigError("ParameterServer: max_staleness applies to mode='async' only (sync has staleness 0)")
        if fixed_point_units is not None:
            check_int(fixed_point_units, "fixed_point_units", "ParameterServer", 1)
            if mode != "sync":
                raise ConfigError("ParameterServer: fixed-point pushes are for mode 'sync' (a step's sums over all "
                                  "workers)")
        self.rank, params = check_setup("ParameterServer", model, layout, mode, want_server=True)
        self.fixed_point_units = fixed_point_units
        self.layout, self.mode, self.max_staleness = layout, mode, max_staleness
        self.index = layout.server_index(self.rank)
        self.workers = layout.workers
        sl = layout.slices(self.index)
        self.names = [layout.names[i] for i, _, _ in sl]
        with torch.no_grad():
            self.flat = torch.cat([params[i].detach().reshape(-1) for i, _, _ in sl]).clone()
        self.grad = torch.zeros_like(self.flat)
        self.params: list[nn.Parameter] = []
        for i, a, b in sl:  # parameters and their gradients are views into the two flat buffers
            p = nn.Parameter(self.flat[a:b].view(params[i].shape))
            p.grad = self.grad[a:b].view(params[i].shape)
            self.params.append(p)
        self.optimizer = optimizer_factory(list(self.params))
        self.scheduler = scheduler_factory(self.optimizer) if scheduler_factory else None
        self.version = 0  # optimizer steps applied
        self._me = f"parameter server rank {self.rank}"

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This shard's current weights, by parameter name (copies)."""
        return {n: p.detach().clone() for n, p in zip(self.names, self.params)}

    def serve(self, num_steps: int, final_pull: bool = True) -> dict:
        """Serve ``num_steps`` pulls and pushes of every worker (then one final pull each); return stats."""
        check_int(num_steps, "num_steps", "ParameterServer.serve", 0)
        t0 = time.perf_counter()
        self.open()
        (self._serve_sync if self.mode == "sync" else self._serve_async)(num_steps, final_pull)
        return self.stats(num_steps, time.perf_counter() - t0)

    def stats(self, num_steps: int, elapsed: float) -> dict:
        """What this server did since ``open``: updates, pushes, pulls, staleness seen."""
        L, K = self.layout, self.max_staleness
        n = sum(self._stale.values())
        return {"role": "server", "rank": self.rank, "server_index": self.index, "mode": self.mode,
                "max_staleness": K, "steps": num_steps, "workers": len(self.workers),
                "updates": self.version, "pushes": self._pushes, "pulls": self._pulls,
                "shard_params": len(self.params), "shard_bytes": L.shard_bytes(self.index),
                "staleness_max": max(self._stale, default=0),
                "staleness_mean": sum(k * v for k, v in self._stale.items()) / n if n else 0.0,
                "staleness_hist": dict(sorted(self._stale.items())), "deferred_pulls": self._deferred,
                "deferred_s": self._deferred_s, "apply_order": self._order, "elapsed_s": elapsed}

    def open(self) -> None:
        """Start serving: zero the counters and send every worker the hello (``serve`` calls it; a
        caller that drives the steps itself, e.g. an elastic job, calls it, then ``sync_step``)."""
        self._stale: collections.Counter = collections.Counter()
        self._order: list[tuple[int, int]] = []
        self._pulls = self._pushes = self._deferred = 0
        self._deferred_s = 0.0
        L, K = self.layout, self.max_staleness
        word = mode_word(self.mode, self.fixed_point_units is not None)
        hello = torch.tensor([MAGIC, word, L.num_servers, L.num_workers, self.index,
                              L.shard_numel(self.index), -1 if K is None else K], dtype=I64)
        self._fan_out([(w, [(hello, TAG_HELLO, "ps_ctrl")]) for w in self.workers], "the hello")

    def _fan_out(self, plan: list, what: str) -> None:
        """Send [(worker, [(tensor, tag, label), ...]), ...]: post every message, then wait in order."""
        hs = [(w, over_transport(self._me, f"worker rank {w}", what, lambda: comm.isend(t, w, tag=tag, label=label)))
              for w, msgs in plan for t, tag, label in msgs]
        for w, h in hs:  # the weights are not updated before every send is complete
            over_transport(self._me, f"worker rank {w}", what, h.wait)

    def _send_weights(self, workers: list[int], step: int, num_steps: int) -> None:
        msgs = [(self.flat, TAG_PULL, "ps_pull")]
        if self.mode == "async":
            msgs.insert(0, (torch.tensor([self.version], dtype=I64), TAG_VERSION, "ps_ctrl"))
        self._fan_out([(w, msgs) for w in workers], f"pull of {step_name(step, num_steps)}")
        self._pulls += len(workers)

    def _step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.version += 1

    def _serve_sync(self, num_steps: int, final_pull: bool) -> None:
        for step in range(num_steps):
            self.sync_step(step, num_steps)
        if final_pull:
            self.final_pull(num_steps)

    def sync_step(self, step: int, num_steps: int, before_update=None) -> None:
        """One step of mode "sync": the weights to every worker, every worker's push, one update.
        ``before_update()`` (an elastic job's commit) runs between the averaged push and the update; if it
        raises, the update is not applied, and :meth:`update` applies it later."""
        fixed = self.fixed_point_units is not None
        if getattr(self, "_bufs", None) is None:
            n = self.layout.push_numel(self.index, fixed)
            self._bufs = [torch.empty(n, dtype=I64 if fixed else self.flat.dtype) for _ in self.workers]
        bufs, what = self._bufs, f"push of step {step}"
        recvs = [over_transport(self._me, f"worker rank {w}", what, lambda: comm.irecv(b, w, tag=TAG_PUSH, label="ps_push"))
                 for w, b in zip(self.workers, bufs)]
        self._send_weights(self.workers, step, num_steps)  # fan-out
        for w, h in zip(self.workers, recvs):  # fan-in, in worker-rank order
            over_transport(self._me, f"worker rank {w}", what, h.wait)
        self._pushes += len(bufs)
        if fixed:
            self._fixed_point_gradient(bufs, step)
        else:
            with torch.no_grad():  # sum in worker-rank order, then one division: deterministic
                self.grad.copy_(bufs[0])
                for b in bufs[1:]:
                    self.grad.add_(b)
                self.grad.div_(len(bufs))
        self._stale[0] += len(bufs)
        if before_update is not None:
            before_update()
        self._step()

    def _fixed_point_gradient(self, bufs: list[torch.Tensor], step: int) -> None:
        """The workers' int64 pushes -> self.grad: the integers added (exact, so any order), each
        parameter's elements converted back once at its exponent, divided by the units."""
        n = self.flat.numel()
        head = bufs[0][n:].view(-1, 2)  # (parameters of the shard, [exponent, non-finite])
        for w, b in zip(self.workers[1:], bufs[1:]):
            if not torch.equal(b[n:], bufs[0][n:]):
                raise CommError(f"{self._me}: protocol error: worker rank {w}'s exponents of step {step} differ from "
                                f"worker rank {self.workers[0]}'s (the workers must share them: the same job?)")
        total = bufs[0][:n]
        for b in bufs[1:]:
            total.add_(b[:n])
        with torch.no_grad():
            for (e, bad), (_, a, b) in zip(head.tolist(), self.layout.slices(self.index)):
                if bad:  # some unit's gradient was not finite: the step's gradient is NaN, as one process's
                    self.grad[a:b].fill_(float("nan"))
                else:
                    dequantize(total[a:b], e, self.fixed_point_units, self.grad.dtype, out=self.grad[a:b])

    def update(self) -> None:
        """Apply the averaged push of the step whose update ``before_update`` interrupted."""
        self._step()

    def final_pull(self, num_steps: int) -> None:
        """The last weights to every worker (their final pull)."""
        self._send_weights(self.workers, num_steps, num_steps)

    def _reader(self, w: int, num_steps: int, final_pull: bool, events: queue.SimpleQueue) -> None:
        """Worker w's messages, in their fixed order, as events ("req"|"push"|"error", w, step, ...)."""
        step, what = 0, "pull request of step 0"
        try:
            for step in range(num_steps + (1 if final_pull else 0)):
                what = f"pull request of {step_name(step, num_steps)}"
                req = torch.empty(1, dtype=I64)
                comm.recv(req, w, tag=TAG_REQ, label="ps_ctrl")
                if int(req[0]) != step:
                    raise ProtocolError(f"pull request for step {int(req[0])}, expected step {step} (do all "
                                        f"workers run the same number of steps as the server?)")
                events.put(("req", w, step))
                if step == num_steps:
                    break
                what = f"push of step {step}"
                hdr, g = torch.empty(2, dtype=I64), torch.empty_like(self.flat)
                comm.recv(hdr, w, tag=TAG_PUSH_HDR, label="ps_ctrl")
                comm.recv(g, w, tag=TAG_PUSH, label="ps_push")
                if int(hdr[0]) != step:
                    raise ProtocolError(f"push for step {int(hdr[0])}, expected step {step}")
                events.put(("push", w, step, int(hdr[1]), g))
        except BaseException as e:  # noqa: BLE001  (delivered to the main thread)
            events.put(("error", w, step, what, e))

    def _admissible(self, outstanding: dict[int, int]) -> bool:
        """May one more pull be answered now without any gradient ever exceeding staleness K?"""
        if self.max_staleness is None:
            return True
        oldest = min(outstanding.values(), default=self.version)
        return (self.version - oldest) + len(outstanding) <= self.max_staleness  # |O| - 1 after adding it

    def _serve_async(self, num_steps: int, final_pull: bool) -> None:
        events: queue.SimpleQueue = queue.SimpleQueue()
        for w in self.workers:
            threading.Thread(target=self._reader, args=(w, num_steps, final_pull, events), daemon=True,
                             name=f"ps-server{self.index}-reader-w{w}").start()
        outstanding: dict[int, int] = {}  # worker -> version its pull was answered at
        waiting: collections.deque = collections.deque()  # (worker, step, arrival time, event number)
        finals: list[int] = []
        total, finals_done, n = len(self.workers) * num_steps, 0, 0
        while self._pushes < total or (final_pull and finals_done < len(self.workers)):
            ev = events.get()
            n += 1
            kind, w, step = ev[:3]
            if kind == "error":
                e = ev[4]
                if isinstance(e, ProtocolError):
                    raise CommError(f"{self._me}: protocol error from worker rank {w} ({ev[3]}): {e}") from e
                raise CommError(f"{self._me}: worker rank {w} disconnected during {ev[3]}: {e}") from e
            if kind == "req":
                if step == num_steps:
                    finals.append(w)
                else:
                    waiting.append((w, step, time.perf_counter(), n))
            else:  # a push: applied now, whatever the other workers do
                v = ev[3]
                if outstanding.pop(w, None) != v:
                    raise CommError(f"{self._me}: protocol error: worker rank {w} pushed step {step} computed at "
                                    f"version {v}, but its pull was answered at another version")
                with torch.no_grad():
                    self.grad.copy_(ev[4])  # unscaled: one optimizer step per push
                staleness = self.version - v
                assert self.max_staleness is None or staleness <= self.max_staleness, "staleness bound violated"
                self._stale[staleness] += 1
                self._order.append((w, step))
                self._pushes += 1
                self._step()
            while waiting and self._admissible(outstanding):  # first come, first served
                w2, step2, t_arrival, n_arrival = waiting.popleft()
                if n_arrival != n:
                    self._deferred += 1
                    self._deferred_s += time.perf_counter() - t_arrival
                self._send_weights([w2], step2, num_steps)
                outstanding[w2] = self.version
            if self._pushes == total and finals:  # final weights once every push is applied
                self._send_weights(finals, num_steps, num_steps)
                finals_done += len(finals)
                finals = []
