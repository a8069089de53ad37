"""Parameter server: ``ps-sync`` and ``ps-async`` (distrain.parallel.parameter_server).

Roles come from PSLayout: the last S ranks serve (they hold their shard and its optimizer and
answer pulls and pushes), the first W = nproc - S work. A worker step is ``pull ->
forward/backward -> push``; ``end_training`` makes the final pull, after which the worker's
model holds the final weights.

ps-sync has a step boundary, so its servers run the training loop like every rank: a server's
``train_step`` is one ``ParameterServer.sync_step`` (the weights out, every push in, one update
at the loop's learning rate), so a server takes part in the loop's collectives (loss sums,
checkpoints, an elastic job's quorum). ps-async has none: its servers ``serve`` all steps
(``serves = True``) while the workers run the loop, and join the loop's collectives afterwards.

Rank 0 (always a worker) evaluates and samples at the end of the run only: mid-run its model
holds the weights of the step before.
(Pulling right after each push instead would hold a pull open while the workers log their
loss together, which deadlocks against a server that bounds staleness.) The state lives on
the servers: each writes shard ``server{s}`` (its flat weights and optimizer). Periodic
checkpoints are refused by the config (mid-run, the state is spread over messages in
flight); the final one is written, with the parameters' names (``checkpoint.reshard.consolidate``
reads it).

``--layout-invariant`` (ps-sync): each worker runs its units of work one at a time and sums their
gradients as int64 at exponents shared by all workers (distrain.parallel.invariant, the workers'
group; worker 0 runs unit 0 and broadcasts the exponents); it pushes the integers, which the servers
add exactly and convert back once (ParameterServer's ``fixed_point_units``). Grad clip happens on the
servers, by the exact norm (``clip_exact``: a fixed-point sum of the squares over the servers' shards).
Every worker ends a step with the whole loss (math.fsum of every unit's), so rank 0 alone weighs it.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.distributed as dist

from distrain import comm
from distrain.parallel.clip import clip_grad_norm
from distrain.parallel.invariant import clip_exact
from distrain.trainer.engines.base import Engine, evaluate_batches, part_loss


class PSEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker

        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.model, self.mode = model, ("sync" if cfg.strategy == "ps-sync" else "async")
        self.ps_layout = L = PSLayout.from_model(model, self.world, cfg.servers)
        self.is_server = L.is_server(self.rank)
        self.serves = self.is_server and self.mode == "async"  # (sync: the servers run the loop step by step)
        self.fixed_point = cfg.layout_invariant  # (validated: ps-sync)
        workers_group = servers_group = None
        if self.mode == "async":
            self.loss_group = dist.new_group(L.workers)  # every rank must create it
        elif self.fixed_point:  # (a mixture's router counts stay the unit's own: no counting over the workers)
            workers_group = dist.new_group(L.workers)  # every rank creates both, in this order
            servers_group = dist.new_group(L.servers) if L.num_servers > 1 else None
        else:
            self._count_routing_over_the_workers(model, L)
        self.label = f"{cfg.strategy} ({L.num_workers} workers, {L.num_servers} server{'s' * (L.num_servers > 1)})"
        self.stats: dict = {}
        self._k, self._t0 = 0, None  # steps this engine ran (the byte check counts them), when the first began
        # the data messages this engine moves (its own ledger: an elastic job rebuilds the engine at each change)
        self.ledger = comm.ledger().__enter__()
        self._stop_ledger = weakref.finalize(self, self.ledger.__exit__, None, None, None)  # (once, at most)
        self.invariant = None  # (workers, --layout-invariant: the units and their int64 sums)
        if self.is_server:
            units = None
            if self.fixed_point:
                from distrain.trainer.checks.invariant import units_of

                torch.set_num_threads(1)  # as the workers (InvariantTraining) and one process
                units, self._servers_group, self._numel = units_of(cfg), servers_group, sum(L.numels)
            self.server = ParameterServer(model, L, optimizer_factory, self.mode, max_staleness=cfg.max_staleness,
                                          fixed_point_units=units)
            self.loss_weight = 0.0  # (no loss here; sync servers still join the loss sum over the world)
        else:
            invariant_loss = None
            if self.fixed_point and cfg.invariant_tp:  # the canonical chunked layers, as every tp layout runs them
                from distrain.trainer.engines.invariant import apply_invariant_tp

                invariant_loss = apply_invariant_tp(cfg, model)
            self.worker = PSWorker(model, L, self.mode, fixed_point=self.fixed_point)
            self.dp_rank, self.dp_size = L.workers.index(self.rank), L.num_workers
            self.loss_fn = part_loss(loss_fn, cfg.batch_size, self.dp_size, self.dp_rank)
            self.loss_weight = 1.0 / L.num_workers
            self._final = False
            if self.fixed_point:
                from distrain.trainer.engines.invariant import InvariantTraining

                self.invariant = InvariantTraining(cfg, model, invariant_loss or self.eval_loss_fn,
                                                   replicas=self.dp_size,
                                                   replica=self.dp_rank, group=workers_group,
                                                   forward_context=self.autocast)
                self.part_unit = self.invariant.samples_per_unit
                self.loss_weight = 1.0 if self.rank == 0 else 0.0  # every worker has the whole loss: exact

    def _count_routing_over_the_workers(self, model, L) -> None:
        """ps-sync with a mixture of experts: the workers' routers count over all workers (the step's
        tokens), so the load-balancing loss is the global batch's and the servers average the gradients
        one process would compute (the grid engine does the same over its data ranks). ps-async's workers
        run at their own pace: a collective in every forward would tie them, so each counts its own."""
        from distrain.models.registry import model_ep_plan
        from distrain.parallel.expert_parallel import sum_router_counts

        plan = model_ep_plan(model)
        if plan is None or not plan.layers(model) or L.num_workers < 2:
            return
        workers = dist.new_group(L.workers)  # every rank must create it (the same model everywhere)
        if not L.is_server(self.rank):
            sum_router_counts(model, plan, workers)

    # -- server -----------------------------------------------------------------------------
    def serve(self, steps: int) -> None:
        from distrain.trainer.task import lr_at

        # the learning rate of every update: sync applies one per step, async one per push (W per step)
        start, per_step = self.cfg.steps - steps, (1 if self.mode == "sync" else self.ps_layout.num_workers)
        self.server.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.server.optimizer, lambda k: lr_at(self.cfg, start + min(k // per_step, steps - 1)) / self.cfg.lr)
        self.stats = self.server.serve(steps)

    def optimizers(self):
        if self.is_server and self.mode == "sync":
            return [self.server.optimizer]  # the loop sets each step's learning rate
        return []  # workers hold none; async servers' schedulers set the learning rate (serve)

    @property
    def reads_data(self) -> bool:
        return not self.is_server

    # -- worker -----------------------------------------------------------------------------
    def train_step(self, x, y, commit=None):
        if self._t0 is None:
            self._t0 = time.perf_counter()
            if self.is_server:
                self.server.open()
        self._k += 1
        if self.is_server:  # one step of mode sync: weights out, every push in, (clip, commit,) one update
            self.server.sync_step(self._k - 1, self.cfg.steps, before_update=self._before_update(commit))
            return None
        w = self.worker
        before = w.pull_s + w.push_s
        w.pull()
        if self.invariant is not None:
            loss = self._fixed_point_step(x, y)
            self.comm_wait_s = w.pull_s + w.push_s - before
            if commit is not None:
                commit(loss)
            return loss
        with self.autocast():
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        if self.cfg.grad_clip:  # each worker's own gradient, before the server averages them
            clip_grad_norm([(p.grad, 1) for p in self.model.parameters()], self.cfg.grad_clip)
        w.push()
        self.comm_wait_s = w.pull_s + w.push_s - before
        if commit is not None:  # (a worker holds no state: nothing to update after it)
            commit(loss.detach())
        return loss.detach()

    def _fixed_point_step(self, x, y) -> torch.Tensor:
        """A worker's units of work, their int64 gradient sums pushed: the step's whole loss (float64)."""
        for p in self.model.parameters():
            p.grad = None
        loss = self.invariant.run(x, y, self.step_index)
        g = self.invariant.grads
        self.worker.push_fixed(g.acc[0], g.exponents, g.nonfinite)
        return torch.tensor(loss, dtype=torch.float64)

    def _before_update(self, commit):
        """A server's work between the summed gradient and the update: the exact-norm clip
        (--layout-invariant), an elastic job's commit."""
        clip = self.fixed_point and bool(self.cfg.grad_clip)
        if not clip:
            return None if commit is None else (lambda: commit(None))

        def before():
            reduce = None
            if self._servers_group is not None:
                def reduce(t, op):
                    comm.all_reduce(t, op=op, group=self._servers_group, algorithm="native")
                    return t
            clip_exact([p.grad for p in self.server.params], self.cfg.grad_clip, addends=self._numel,
                       all_reduce=reduce)
            if commit is not None:
                commit(None)
        return before

    def finish_step(self) -> None:
        if self.is_server:  # the pushes of the step are in and averaged: apply them
            self.server.update()

    def buffers(self):
        return list(self.model.buffers())

    def end_training(self) -> None:
        if self.is_server:  # (sync: async servers end in serve)
            self.server.final_pull(self.cfg.steps)
            self.stats = self.server.stats(self._k, time.perf_counter() - (self._t0 or time.perf_counter()))
            return
        self.worker.pull()  # the final weights, the same on every worker
        self._final = True

    def evaluate(self, batches):
        if self.rank != 0 or not self._final:
            return None
        return evaluate_batches(self.model, self.eval_loss_fn, batches, accuracy=self.cfg.data_kind != "text")

    def sample_model(self):
        return self.model

    # -- checkpoints ------------------------------------------------------------------------
    @classmethod
    def layout_of(cls, cfg) -> dict:
        return {"workers": cfg.nproc - cfg.servers, "servers": cfg.servers}

    @property
    def shard(self):
        return f"server{self.ps_layout.server_index(self.rank)}" if self.is_server else None

    def state_dict(self) -> dict:
        from distrain.checkpoint.reshard import shard_meta

        if not self.is_server:
            return {}  # a worker holds no state: it pulls the weights every step
        names = self.server.names  # (the whole model's names; "model" holds views of "flat")
        return {"flat": self.server.flat, "optimizer": self.server.optimizer.state_dict(),
                "model": {n: p.detach() for n, p in zip(names, self.server.params)},
                **shard_meta({n: n for n in names}, order=names)}

    def load_state_dict(self, state: dict) -> None:
        if self.is_server:
            with torch.no_grad():
                self.server.flat.copy_(state["flat"])
            self.server.optimizer.load_state_dict(state["optimizer"])

    # -- report -----------------------------------------------------------------------------
    def report(self, ledger, steps: int) -> dict:
        """Staleness and the data messages' bytes of this engine (its own ledger and step count: an
        elastic job's last engine covers the steps since the last membership change) against the
        fan-in/fan-out formula."""
        from distrain.parallel.parameter_server import expected_ps_bytes

        self._stop_ledger()
        steps = steps if self.serves else self._k  # (async servers: every step, in serve)
        stats = dict(self.stats) if self.is_server else self.worker.stats()
        stats["ledger"] = {f"{lab}_{d}": getattr(self.ledger.get(lab, "p2p"), f"bytes_{d}")
                           for lab in ("ps_pull", "ps_push") for d in ("sent", "recv")}
        stats["steps"] = steps
        every = comm.all_gather_data(stats, algorithm=None)  # (data only; outside the ledger, as before)
        L = self.ps_layout
        servers = [s for s in every if s and s.get("role") == "server"]
        expected = expected_ps_bytes(L, every[0]["steps"], final_pull=True,  # (rank 0: a worker)
                                     fixed_point=self.fixed_point)
        extra = {"servers": [{k: v for k, v in s.items() if k != "apply_order"} for s in servers],
                 "staleness_max": max(s["staleness_max"] for s in servers),
                 "ps_bytes": [{"rank": r, "role": L.role(r), "ledger": every[r]["ledger"],
                               "expected": {k: v for k, v in expected[r].items() if k.startswith("ps_")}}
                              for r in range(self.world)]}
        extra["ps_bytes_match"] = all(row["ledger"] == row["expected"] for row in extra["ps_bytes"])
        return extra

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        return [("max staleness seen", str(summary["staleness_max"])),
                ("PS bytes = W*N_s fan-in/out", "exact" if summary["ps_bytes_match"] else "MISMATCH")]
