"""ZeRO data parallelism (``--strategy zero1|zero2|zero3``): distrain.parallel.zero's engine.

Every rank reads its slice of the global batch; the ``Zero`` engine averages gradients by
reduce-scatter during backward and gives each rank the optimizer state (stage 1), also the
gradients (stage 2) and also the parameters (stage 3) of its shard only (docs/zero.md).
Each rank writes its own checkpoint shard ``zero-rank{r}`` (shards and optimizer state), so
a resume needs the same stage and --nproc. Validation runs on every rank (stage 3 gathers
each layer for it) and rank 0 reports it; text samples are skipped (the model is sharded).
"""

from __future__ import annotations

import torch

from distrain.trainer.engines.base import Engine, evaluate_batches, part_loss


class ZeroEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        from distrain.parallel.zero import Zero

        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.stage = int(cfg.strategy.removeprefix("zero"))
        self.zero = Zero(model, optimizer_factory, stage=self.stage, algorithm=cfg.algorithm,
                         bucket_cap_mb=cfg.bucket_cap_mb)
        self.optimizer = self.zero.optimizer
        self.dp_rank, self.dp_size = self.rank, self.world
        self.loss_fn = part_loss(loss_fn, cfg.batch_size, self.dp_size, self.dp_rank)
        self.loss_weight = 1.0 / self.world
        self.label = f"zero{self.stage} ({cfg.algorithm})"

    def train_step(self, x, y, commit=None):
        """Forward/backward of this rank's slice (in ``accum_steps`` chunks: the shards' gradients
        accumulate), clipping by the global norm over every rank's shard, ``commit``, optimizer step
        (stages 1-2 all-gather the parameters after it, so an elastic job keeps ZeRO's start-of-step
        pieces instead of committing: trainer/guard.py)."""
        self.zero.zero_grad()
        k = self.cfg.accum_steps
        total = torch.zeros((), dtype=torch.float64, device=x.device)
        for xi, yi in zip(x.chunk(k), y.chunk(k)):
            with self.autocast():
                loss = self.loss_fn(self.zero(xi), yi) / k
            loss.backward()
            total += loss.detach().double()
        if self.cfg.grad_clip:
            self.zero.clip_grad_norm_(self.cfg.grad_clip)
        if commit is not None:
            commit(total)
        self.zero.step()
        return total

    def model_params(self):
        return self.zero.parameters()

    def evaluate(self, batches):
        # every rank runs it (stage 3's forward gathers each layer: a collective); rank 0 reports
        out = evaluate_batches(self.zero, self.eval_loss_fn, batches, accuracy=self.cfg.data_kind != "text")
        return out if self.rank == 0 else None

    @classmethod
    def layout_of(cls, cfg) -> dict:
        return {"zero": int(cfg.strategy.removeprefix("zero")), "dp": cfg.nproc}

    @property
    def shard(self):
        return f"zero-rank{self.rank}"

    def state_dict(self) -> dict:
        from distrain.checkpoint.reshard import zero_shard_state

        return zero_shard_state(self.zero)  # (the trainer's file has its own "format" key)

    def load_state_dict(self, state: dict) -> None:
        from distrain.checkpoint.reshard import load_zero_shard

        load_zero_shard(self.zero, state)

    def load_full(self, full: dict) -> None:
        from distrain.checkpoint.form import whole
        from distrain.checkpoint.reshard import local_view, zero_names

        self.zero.load_full_state_dict(whole(**local_view(full, zero_names(self.zero))))


    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        m = self.zero.memory()
        return [("held per rank (rank 0)", f"params {m['params'] / 1e6:.2f} MB, grads {m['grads'] / 1e6:.2f} MB, "
                                           f"optimizer {m['optimizer'] / 1e6:.2f} MB")]
