"""Parameter server: ``ps-sync`` and ``ps-async`` (distrain.parallel.parameter_server).

Roles come from PSLayout: the last S ranks serve (``serves = True``: they hold their shard
and its optimizer and answer pulls and pushes), the first W = nproc - S work. A worker step
is ``pull -> forward/backward -> push``; ``end_training`` makes the final pull, after which
the worker's model holds the final weights. Rank 0 (always a worker) evaluates and samples
then, at the end of the run only: mid-run its model holds the weights of the step before.
(Pulling right after each push instead would hold a pull open while the workers log their
loss together, which deadlocks against a server that bounds staleness.) The state lives on
the servers: each writes shard ``server{s}`` (its flat weights and optimizer). Periodic
checkpoints are refused by the config (mid-run, the state is spread over messages in
flight); the final one is written.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from distrain.trainer.engines.base import Engine, evaluate_batches


class PSEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        from distrain.parallel.parameter_server import ParameterServer, PSLayout, PSWorker

        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.model, self.mode = model, ("sync" if cfg.strategy == "ps-sync" else "async")
        self.ps_layout = L = PSLayout.from_model(model, self.world, cfg.servers)
        self.loss_group = dist.new_group(L.workers)  # every rank must create it
        self.serves = L.is_server(self.rank)
        self.label = f"{cfg.strategy} ({L.num_workers} workers, {L.num_servers} server{'s' * (L.num_servers > 1)})"
        self.stats: dict = {}
        # an elastic job (ps-sync) drives the servers step by step from its loop (train_step below), so that
        # a server takes part in each step's quorum like every rank; a plain job's servers run serve()
        self.stepwise = bool(getattr(cfg, "elastic", None))
        self._k, self._t0 = 0, None
        if self.serves:
            self.server = ParameterServer(model, L, optimizer_factory, self.mode, max_staleness=cfg.max_staleness)
        else:
            self.worker = PSWorker(model, L, self.mode)
            self.dp_rank, self.dp_size = L.workers.index(self.rank), L.num_workers
            self.loss_weight = 1.0 / L.num_workers
            self._final = False

    # -- server -----------------------------------------------------------------------------
    def serve(self, steps: int) -> None:
        from distrain.trainer.task import lr_at

        # the learning rate of every update: sync applies one per step, async one per push (W per step)
        start, per_step = self.cfg.steps - steps, (1 if self.mode == "sync" else self.ps_layout.num_workers)
        self.server.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.server.optimizer, lambda k: lr_at(self.cfg, start + min(k // per_step, steps - 1)) / self.cfg.lr)
        self.stats = self.server.serve(steps)

    def optimizers(self):
        if self.stepwise and self.serves:
            return [self.server.optimizer]  # the loop sets each step's learning rate
        return []  # the servers' schedulers set the learning rate (serve)

    # -- worker -----------------------------------------------------------------------------
    def train_step(self, x, y):
        if self.serves:  # (stepwise only) one step of mode sync: weights out, every push in, one update
            if self._t0 is None:
                self._t0 = time.perf_counter()
                self.server.open()
            self.server.sync_step(self._k, self.cfg.steps)
            self._k += 1
            return None
        w = self.worker
        before = w.pull_s + w.push_s
        w.pull()
        with self.autocast():
            loss = self.loss_fn(self.model(x), y)
        loss.backward()
        if self.cfg.grad_clip:  # each worker's own gradient, before the server averages them
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        w.push()
        self.comm_wait_s = w.pull_s + w.push_s - before
        return loss.detach()

    def end_training(self) -> None:
        if self.serves:  # (stepwise only)
            self.server.final_pull(self.cfg.steps)
            self.stats = self.server.stats(self._k, time.perf_counter() - (self._t0 or time.perf_counter()))
            return
        self.worker.pull()  # the final weights, the same on every worker
        self._final = True

    def evaluate(self, batches):
        if self.rank != 0 or not self._final:
            return None
        return evaluate_batches(self.model, self.loss_fn, batches, accuracy=self.cfg.data_kind != "text")

    def sample_model(self):
        return self.model

    # -- checkpoints ------------------------------------------------------------------------
    @classmethod
    def layout_of(cls, cfg) -> dict:
        return {"workers": cfg.nproc - cfg.servers, "servers": cfg.servers}

    @property
    def shard(self):
        return f"server{self.ps_layout.server_index(self.rank)}" if self.serves else None

    def state_dict(self) -> dict:
        if not self.serves:
            return {}  # a worker holds no state: it pulls the weights every step
        return {"flat": self.server.flat, "optimizer": self.server.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.serves:
            with torch.no_grad():
                self.server.flat.copy_(state["flat"])
            self.server.optimizer.load_state_dict(state["optimizer"])

    # -- report -----------------------------------------------------------------------------
    def report(self, ledger, steps: int) -> dict:
        from distrain.parallel.parameter_server import expected_ps_bytes

        stats = dict(self.stats) if self.serves else self.worker.stats()
        # the data messages' bytes of this rank, to check against the fan-in/fan-out formula
        stats["ledger"] = {f"{lab}_{d}": getattr(ledger.get(lab, "p2p"), f"bytes_{d}")
                           for lab in ("ps_pull", "ps_push") for d in ("sent", "recv")}
        every = [None] * self.world
        dist.all_gather_object(every, stats)
        L = self.ps_layout
        servers = [s for s in every if s and s.get("role") == "server"]
        expected = expected_ps_bytes(L, steps, final_pull=True)
        extra = {"servers": [{k: v for k, v in s.items() if k != "apply_order"} for s in servers],
                 "staleness_max": max(s["staleness_max"] for s in servers),
                 "ps_bytes": [{"rank": r, "role": L.role(r), "ledger": every[r]["ledger"],
                               "expected": {k: v for k, v in expected[r].items() if k.startswith("ps_")}}
                              for r in range(self.world)]}
        # (an elastic job's ledger spans every membership: the count of one fixed layout does not apply)
        extra["ps_bytes_match"] = None if self.stepwise else all(
            row["ledger"] == row["expected"] for row in extra["ps_bytes"])
        return extra

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        return [("max staleness seen", str(summary["staleness_max"])),
                ("PS bytes = W*N_s fan-in/out", {True: "exact", False: "MISMATCH"}.get(
                    summary["ps_bytes_match"], "not checked (elastic: the layout changed)"))]
