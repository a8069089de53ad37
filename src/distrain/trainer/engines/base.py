"""The Engine contract: one way of training, as the training loop (``trainer/loop.py``) sees it.

An engine owns the model as this rank holds it (whole, wrapped for data parallelism, or a
tensor/pipeline shard), its optimizer, and its communication. The loop owns everything
else: data, resume, logging, checkpoint sets, the report. Per global step the loop calls

    engine.set_lr(lr)
    loss = engine.train_step(x, y, commit)   # forward, backward, gradient sync, commit, optimizer step

with this rank's part ``(dp_rank, dp_size)`` of the global batch (``commit``: an elastic job's quorum
hook, None in a fixed job; see ``train_step``), ``end_training()`` right after the last step, and logs
``sum over loss_group of loss * loss_weight`` (the global batch's mean loss).

Parts may differ in size by one (an elastic job's live replicas need not divide the batch:
DistributedBatchSampler.part). An engine scales its training loss by ``n_d * D / B`` at
construction (:func:`part_loss`, exactly 1 when D divides B): data parallelism averages gradients
over the D replicas, so the sum is the exact gradient of the global batch's mean loss for any D.
Evaluation uses the unscaled loss (``eval_loss_fn``).

A rank with ``serves = True`` (a ps-async server) runs ``serve(steps)`` instead of the
loop and joins the loop's collective calls afterwards (checkpoint set, traffic, report); a rank
with ``reads_data = False`` (a ps-sync server) runs the loop without batches.

Checkpoints: ``shard`` names the state this rank holds (replicas hold the same one; None:
nothing, e.g. a parameter-server worker) and ``writes_shard`` says whether this rank is the
one that writes it; ``state_dict``/``load_state_dict`` move it. ``layout_of(cfg)`` goes into
the manifest, and a resume with another layout is refused before any rank starts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain.data.sampler import part_bounds
from distrain.models.outputs import logits_of
from distrain.trainer.config import TrainConfig

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Engine(ABC):
    """Base of every engine; subclasses set the attributes below in ``__init__``."""

    serves: bool = False
    holds_whole_state: bool = False  # every rank holds the whole model and optimizer state (replicas)
    dp_rank: int = 0  # which slice of the global batch this rank reads
    dp_size: int = 1  # into how many slices the global batch is cut
    loss_group = None  # the ranks whose weighted losses sum to the logged loss (None: the world)
    loss_weight: float = 1.0
    label: str = ""  # what the progress bar, plot and summary call this run, e.g. "dp1×tp2×pp2"
    part_unit: int = 1  # this rank's part of the batch is whole multiples of this many samples (--layout-invariant)
    step_index: int = 0  # the global step train_step runs (the loop sets it; layout-invariant units draw by it)

    def __init__(self, cfg: TrainConfig, model: nn.Module, loss_fn: LossFn, optimizer_factory: OptimizerFactory):
        self.cfg = cfg
        self.loss_fn = loss_fn  # the training loss: part_loss(...) once the engine knows its dp part
        self.eval_loss_fn = loss_fn
        self.optimizer_factory = optimizer_factory
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = next(model.parameters(), torch.empty(0)).device  # this rank's device (the loop put it there)
        self._moe_model = model  # read by step_metrics (a mixture of experts' drop tally)
        self.comm_wait_s: float | None = None  # seconds the last step waited on communication (None: not measured)

    # -- training -------------------------------------------------------------------------
    @abstractmethod
    def train_step(self, x: torch.Tensor, y: torch.Tensor, commit=None) -> torch.Tensor | None:
        """One global step on this rank's part; the loss where this rank computes one, else None.

        ``commit(loss)`` (an elastic job's quorum, trainer/guard.py), when given, is called once the step's
        gradients are synchronised and before anything of the state changes; then :meth:`finish_step`
        applies the update. An exception from it leaves the state at the step's start (but for buffers
        a forward changed, which the guard puts back), and ``finish_step`` can still complete the step."""

    def finish_step(self) -> None:
        """The step's update (the optimizer step) after the commit; local to this rank."""
        raise NotImplementedError(f"{type(self).__name__} has no separate update step")

    def start_state(self) -> dict:
        """Within a step whose commit was not completed, the state of the step's start (the guard's copy to go
        back to). Here the live state: an update follows the commit, so nothing changed before it; an engine
        that changes its state before the commit (DiLoCo's outer step) keeps a copy and returns it."""
        return self.state_dict()

    def piece_state(self) -> dict:
        """:meth:`state_dict`'s tree for a copy taken at once (an elastic job's per-step piece, which packs
        every tensor into its buffer): tensors may be the live ones. Here :meth:`state_dict` itself."""
        return self.state_dict()

    def load_newcomer(self, state: dict) -> None:
        """Load the state a live peer sent this newcomer (an elastic job's replacement rank): a replica's,
        so here :meth:`load_state_dict`; an engine whose ranks hold states of their own (DiLoCo) takes only
        what is common to all."""
        self.load_state_dict(state)

    def buffers(self) -> list[torch.Tensor]:
        """The module buffers this rank's forward may change (e.g. running statistics)."""
        return []

    @abstractmethod
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict | None:
        """{"val_loss": mean loss, and "val_accuracy" for classifiers} on rank 0 at least (None
        elsewhere). Every training rank calls it."""

    def set_lr(self, lr: float) -> None:
        """The learning rate of the coming step (the loop computes it from the step: task.lr_at)."""
        for opt in self.optimizers():
            for group in opt.param_groups:
                group["lr"] = lr

    def optimizers(self) -> list[torch.optim.Optimizer]:
        opt = getattr(self, "optimizer", None)
        return [opt] if opt is not None else []

    def autocast(self):
        """The forward/loss context: bf16 autocast with ``--autocast bf16`` (on this rank's device)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.autocast == "bf16")

    def end_training(self) -> None:
        """Called once right after the last step's ``train_step`` (e.g. a final pull of weights)."""

    def step_metrics(self) -> dict:
        """Extra numbers for the last step's metrics line: a mixture of experts' ``moe_dropped`` and
        ``moe_routed`` (slots over capacity, slots routed; summed over the step's ranks where expert
        parallelism sums the router's counts, else this rank's); {} for other models."""
        from distrain.models.moe import moe_metrics

        return moe_metrics(self._moe_model)

    @property
    def reads_data(self) -> bool:
        """Whether the loop feeds this rank its part of each batch (False: ``train_step(None, None)``)."""
        return True

    def serve(self, steps: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not serve")

    # -- replicas (--check-replicas, trainer/replicas.py) ----------------------------------
    @property
    def replica_group(self):
        """The process group of the ranks that hold this rank's parameters and optimizer state bit for
        bit (its replicas), or None where it has none (the config refuses --check-replicas there)."""
        return None

    def replica_state(self) -> list[torch.Tensor]:
        """What the replicas hold identically, in a fixed order: the parameters, then the optimizer's
        state. Its first tensor is where DISTRAIN_INJECT flips a bit."""
        raise NotImplementedError(f"{type(self).__name__} holds no replica")

    def replica_mismatch(self) -> tuple[list[int], list[int]]:
        """Collective over ``replica_group``: (its ranks, those whose state's bits differ; [] when all
        agree), every rank of the group getting the same answer (trainer/replicas.py mismatched)."""
        from distrain.trainer.replicas import mismatched

        return mismatched(self.replica_state(), self.replica_group)

    # -- checkpoints ----------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def layout_of(cls, cfg: TrainConfig) -> dict:
        """How the state is split (recorded in the manifest; resume requires the same)."""

    @property
    def layout(self) -> dict:
        return self.layout_of(self.cfg)

    @property
    @abstractmethod
    def shard(self) -> str | None:
        """The name of the state this rank holds in a checkpoint set, or None."""

    @property
    def writes_shard(self) -> bool:
        """Whether this rank writes its shard (one rank per distinct shard)."""
        return self.shard is not None

    @abstractmethod
    def state_dict(self) -> dict:
        """This rank's shard: model and optimizer state."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None: ...

    def load_full(self, full: dict) -> None:
        """Load this rank's part of a consolidated checkpoint (checkpoint/reshard.py), whatever layout
        wrote it (``--resume --reshard``). Every rank calls it."""
        from distrain.errors import ConfigError

        raise ConfigError(f"--reshard: {self.label or type(self).__name__} cannot load a checkpoint written with "
                          f"another layout; resume with the layout it was written with")

    # -- report ---------------------------------------------------------------------------
    def report(self, ledger, steps: int) -> dict:
        """Extra summary fields (collective: every rank calls it; rank 0's result is used)."""
        return {}

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        """Extra lines for the summary table."""
        return []

    def sample_model(self) -> nn.Module | None:
        """The whole model on rank 0 for text samples, or None when it is sharded."""
        return None


def score(loss_fn: LossFn, output, target: torch.Tensor, accuracy: bool) -> torch.Tensor:
    """One batch's evaluation row, (3,) float64: [its mean loss ``loss_fn(output, target)``, correct,
    counted]: with ``accuracy`` and integer targets whose logits (models.logits_of) have one more dim
    (class scores), the samples whose arg-max logit is the target; else 0, 0. Every engine's
    evaluation scores with it (``evaluate_batches``, the grid engine's collective one)."""
    loss = loss_fn(output, target).detach().double()
    right = seen = torch.zeros((), dtype=torch.float64, device=loss.device)
    if accuracy and not target.is_floating_point():
        logits = logits_of(output)
        if logits.dim() == target.dim() + 1:
            right = (logits.argmax(dim=-1) == target).sum().double()
            seen = torch.tensor(float(target.numel()), dtype=torch.float64, device=loss.device)
    return torch.stack([loss, right, seen])


@torch.no_grad()
def evaluate_batches(net: nn.Module, loss_fn: LossFn, batches, accuracy: bool) -> dict:
    """Mean of ``loss_fn(net(x), y)`` over ``batches`` in eval mode; with ``accuracy``, also the
    share of samples whose arg-max logit is the target (``score``)."""
    was = net.training
    net.eval()
    rows = [score(loss_fn, net(x), y, accuracy) for x, y in batches]
    net.train(was)
    losses = [float(r[0]) for r in rows]
    out = {"val_loss": sum(losses) / len(losses)}
    right, seen = sum(int(r[1]) for r in rows), sum(int(r[2]) for r in rows)
    if seen:
        out["val_accuracy"] = right / seen
    return out


class _ScaledLoss:
    def __init__(self, loss_fn: LossFn, scale: float):
        self.loss_fn, self.scale = loss_fn, scale

    def __call__(self, output, target):
        return self.loss_fn(output, target) * self.scale


def part_loss(loss_fn: LossFn, batch: int, dp_size: int, dp_rank: int) -> LossFn:
    """``loss_fn`` for replica ``dp_rank`` of ``dp_size`` on a global batch of ``batch``: scaled by
    ``n_d * D / B`` (n_d its part's size, DistributedBatchSampler.part), the function itself when that
    is 1 (D divides B). With gradients averaged over the D replicas, sum_d n_d/B * grad(mean_d) is the
    gradient of the global batch's mean loss."""
    lo, hi = part_bounds(batch, dp_size, dp_rank)
    scale = (hi - lo) * dp_size / batch
    return loss_fn if scale == 1 else _ScaledLoss(loss_fn, scale)
