"""One process (``--strategy single``), and the base of the two comparison baselines (baselines.py).

The model is whole; ``wrap`` (none here) may make ``backward()`` average the gradients over the
ranks (torch's DDP). Rank 0 evaluates and writes the checkpoint shard ``tp0-pp0``, the grid
engine's name for a whole replica, so a single-process run and ``--strategy ddp`` resume each
other's checkpoints with ``--reshard``.
"""

from __future__ import annotations


import torch.nn as nn

from distrain.parallel.clip import clip_grad_norm
from distrain.parallel.data_parallel import accumulate_gradients
from distrain.trainer.engines.base import Engine, evaluate_batches, part_loss


class SingleEngine(Engine):
    holds_whole_state = True

    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.model = model
        invariant_loss = None
        if cfg.layout_invariant and cfg.invariant_tp:  # the canonical chunked layers, as every tp layout runs them
            from distrain.trainer.engines.invariant import apply_invariant_tp

            invariant_loss = apply_invariant_tp(cfg, model)
        self.net = self.wrap(model)
        self.optimizer = optimizer_factory(self.net.parameters())
        self.dp_rank, self.dp_size = self.rank, self.world
        self.loss_fn = part_loss(loss_fn, cfg.batch_size, self.dp_size, self.dp_rank)
        self.loss_weight = 1.0 / self.world
        self.label = self.describe()
        self.invariant = None
        if cfg.layout_invariant:  # (validated: strategy single)
            from distrain.trainer.engines.invariant import InvariantTraining

            self.invariant = InvariantTraining(cfg, self.model, invariant_loss or self.eval_loss_fn, replicas=1,
                                               replica=0, forward_context=self.autocast)
            self.part_unit = self.invariant.samples_per_unit

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def describe(self) -> str:
        return "single"

    def train_step(self, x, y, commit=None):
        """Forward/backward of ``accum_steps`` equal micro-batches of this rank's slice (gradients
        synchronised on the last one only: no_sync before), clipping, ``commit``, optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.invariant is not None:
            total = self.invariant.step(x, y, self.step_index)
            if commit is not None:
                commit(total)
            self.finish_step()
            return total
        total = accumulate_gradients(self.net, self.loss_fn, x, y, self.cfg.accum_steps, forward_context=self.autocast)
        if self.cfg.grad_clip:  # the replicas hold the same (averaged) gradients: no sum over ranks
            clip_grad_norm([(p.grad, 1) for p in self.model.parameters()], self.cfg.grad_clip)
        if commit is not None:
            commit(total)
        self.finish_step()
        return total

    def finish_step(self) -> None:
        self.optimizer.step()

    def buffers(self):
        return list(self.model.buffers())

    def evaluate(self, batches):
        if self.rank != 0:
            return None
        return evaluate_batches(self.model, self.eval_loss_fn, batches, accuracy=self.cfg.data_kind != "text")

    @classmethod
    def layout_of(cls, cfg) -> dict:
        return {"dp": cfg.nproc, "tp": 1, "pp": 1}

    @property
    def shard(self):
        return "tp0-pp0"

    @property
    def writes_shard(self) -> bool:
        return self.rank == 0

    def _names(self) -> dict[str, str]:
        return {n: n for n in self.model.state_dict()}

    def state_dict(self) -> dict:
        from distrain.checkpoint.reshard import shard_meta

        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                **shard_meta(self._names(), order=[n for n, _ in self.model.named_parameters()])}

    def load_full(self, full: dict) -> None:
        from distrain.checkpoint.reshard import load_plain, local_view

        load_plain(self.model, self.optimizer, [n for n, _ in self.model.named_parameters()],
                   local_view(full, self._names()))

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def sample_model(self):
        return self.model
