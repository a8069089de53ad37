"""``parallelize()``: tensor, then context, then expert, then pipeline, then data parallelism, in that fixed order.

The model (``layers`` = a list of modules run in a loop, e.g. the GPT's [Embedding, Block x n,
Head]) knows nothing of parallelism; its tensor-parallel plan sits beside it. Every rank
builds the same seeded full model and calls::

    pm = parallelize(model, topo, loss_fn=lm_loss, tp_plan=gpt_tp_plan(), algorithm="ring",
                     microbatches=4, schedule="1f1b", cp_plan=gpt_cp_plan(), cp_algorithm="ring")
    loss = pm.train_step(x, y)   # this data-parallel replica's batch; gradients are ready
    optimizer.step()             # over pm.parameters()

Why this order:

1. **Tensor parallel first** (``topo.tp_group``): the plan swaps the Linear/Embedding modules
   *inside* every layer for their Megatron shards (column/row split, f/g all-reduces),
   keeping the layer list intact, so the pipeline split below still sees whole layers.
2. **Context parallel second** (``topo.cp_group``, when cp > 1): the CP plan gives the modules
   that compute positions and attention this rank's place in the sequence
   (distrain.parallel.context_parallel: chunks i and 2N-1-i, ring or all-to-all attention),
   inside the layers, so the layer list stays intact as well. ``train_step`` then keeps this
   rank's tokens of the inputs and targets (``ContextParallel.split``, the plan's sequence dims).
2b. **Expert parallel** (``topo.ep_group``, when the model has mixture-of-experts layers and an
   ``ep_plan``): every mixture layer keeps this rank's E/ep experts and sends tokens to the others'
   by all-to-all (distrain.parallel.expert_parallel); the router's counts are summed over dp x cp
   (the step's tokens), so the load-balancing loss is the one-process loss even with ep = 1. After
   backward the expert gradients are summed over ``topo.edp_group`` (the replicas of the same experts)
   and divided by dp x cp; DDP below leaves them alone.
3. **Pipeline split third** (``topo.pp_group``): the rank keeps the contiguous slice of
   layers of stage ``topo.pp_rank``; activations go to the same tp rank of the next stage.
   With ``schedule="interleaved"`` the layers are cut into pp x v parts and the rank keeps
   the v non-contiguous parts r, pp + r, 2 pp + r, ... (an ``InterleavedStage``: Megatron's
   virtual stages, the bubble v times smaller; activations go round the ring of ranks v times).
   Balancing by parameter count is the same on every tp rank, since every tp rank holds
   the same share of each layer.
4. **Data parallel last** (``topo.dp_cp_group``: the dp group when cp is 1): DDP wraps exactly
   the parameters this rank now holds; the ranks of a dp x cp group have the same tp and pp
   coordinates, so they hold the same shard, and rank 0 of the group broadcasts it. Data and
   context parallelism both split the step's tokens (samples, or chunks of each sequence, equal
   in number), so the gradient of the mean over all of them is the average over dp x cp of the
   ranks' gradients of their own means (Megatron-LM reduces over its dp-cp group alike). With a
   pipeline, the micro-batch backwards run under ``no_sync()`` and the gradients are averaged
   once per step.
   ``zero_stage=1|2|3`` puts ZeRO (distrain.parallel.zero) over that group instead of
   DDP: its ranks, which hold the same tp/pp shard, split its optimizer state (and
   gradients, and parameters) among themselves; ``optimizer=`` is then the factory the
   ZeRO engine builds over this rank's flat shards (``pm.optimizer``). With a pipeline,
   stage 1 reduce-scatters once per step (micro-batches under ``no_sync``); stage 2
   reduce-scatters after every micro-batch's backward, so no full-size gradient outlives
   it (M x stage 1's reduce-scatter volume; interleaved: after every chunk's backward of a
   micro-batch, M x v x, the chunks' units that got no gradient reduced as zeros), except under a split-backward schedule
   (zb-h1: the deferred W passes write ``.grad`` outside autograd's hooks), where it too
   reduces once per step and holds full-size gradients until then; stage 3 is refused (it would all-gather each
   layer twice per micro-batch; DeepSpeed refuses ZeRO-2/3 with pipelines altogether).

Contract: every rank of the world calls ``parallelize`` with the same topology sizes, and
``train_step`` once per step; first-stage ranks need ``x``, last-stage ranks ``y``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from distrain.errors import ConfigError
from distrain.parallel.context_parallel import ContextParallel, CPPlan, apply_context_parallel
from distrain.parallel.data_parallel import DistributedDataParallel, accumulate_gradients
from distrain.parallel.expert_parallel import (
    EPPlan, ExpertParallel, apply_expert_parallel, check_ep_layout, expert_parameter_names, reduce_expert_gradients,
)
from distrain.parallel.pipeline_parallel import InterleavedStage, PipelineStage, interleaved_step, partition, \
    pipeline_step
from distrain.parallel.pipeline_parallel.schedule import SPLIT_BACKWARD
from distrain.parallel.tensor_parallel import TPGroup, apply_tensor_parallel, is_sequence_parallel, tp_shard_info
from distrain.parallel.tensor_parallel.plan import TPPlan, as_plan
from distrain.topology import Topology

if TYPE_CHECKING:
    from distrain.parallel.zero import Zero

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ParallelModel:
    topo: Topology
    module: nn.Module  # what this rank trains: the (TP-sharded) model or pipeline stage
    stage: PipelineStage | InterleavedStage | None  # interleaved: schedule "interleaved", v chunks per rank
    ddp: DistributedDataParallel | None
    algorithm: str
    microbatches: int
    schedule: str
    criterion: Loss                     # the user's loss on the full output
    tp_plan: TPPlan | None = None
    zero: "Zero | None" = None          # ZeRO over the dp group (in place of ddp)
    tp_info: dict | None = None         # {name in module: ShardInfo}, taken before ZeRO-3 removes the parameters
    cp: ContextParallel | None = None   # this rank's part of the sequence (cp > 1)
    cp_plan: CPPlan | None = None
    ep: ExpertParallel | None = None    # the mixture layers' dispatch (a model with experts, ep_plan given)
    expert_params: list | None = None  # this rank's experts' parameters, reduced over edp (ep > 1)
    tp: TPGroup | None = None           # the layers' group when tp_chunks (--layout-invariant) applied the plan

    def split(self, x: torch.Tensor | None, what: str = "input") -> torch.Tensor | None:
        """This rank's tokens of a whole batch tensor (inputs or targets: the plan's dims); as it is
        without context parallelism."""
        if self.cp is None or x is None:
            return x
        return self.cp.split(x, self.cp_plan.input_dim if what == "input" else self.cp_plan.target_dim)

    def parameters(self):
        """What the optimizer updates: the module's parameters, or ZeRO's flat shards."""
        return self.zero.parameters() if self.zero is not None else self.module.parameters()

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """With ZeRO, the optimizer it built over this rank's shards (else the caller builds one)."""
        return self.zero.optimizer if self.zero is not None else None

    def loss_fn(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of this rank's output: the plan's loss on shards when tp > 1 and the plan
        keeps the output sharded (the GPT's vocab-parallel cross entropy), else ``criterion``."""
        if self.tp is not None and self.tp_plan is not None and self.tp_plan.loss is not None:
            return self.tp_plan.loss(output, targets, self.tp)  # (--layout-invariant: the canonical sums)
        if self.topo.tp > 1 and self.tp_plan is not None and self.tp_plan.loss is not None:
            return self.tp_plan.loss(output, targets, TPGroup(self.topo.tp_group, self.algorithm))
        return self.criterion(output, targets)
    @property
    def has_loss(self) -> bool:
        """Whether this rank computes the loss (the last pipeline stage)."""
        return self.stage is None or self.stage.is_last

    @property
    def can_carry(self) -> bool:
        """Whether ``train_step(carry=...)`` can pass a few values along with the gradients (DDP's last
        bucket; no pipeline)."""
        return self.stage is None and self.ddp is not None and self.ddp.can_carry

    def train_step(self, x: torch.Tensor, y: torch.Tensor, accum_steps: int = 1,
                   carry: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Forward and backward of this replica's batch; returns the loss where it is computed (with
        context parallelism: the mean over this rank's tokens).

        Without a pipeline the batch runs as ``accum_steps`` equal chunks (``accumulate_gradients``: the
        gradients are synchronised on the last one only), and the loss returned is their sum in float64;
        a pipeline accumulates over its micro-batches instead (``accum_steps`` must be 1). ``carry(loss)``
        (with :attr:`can_carry`): values to all-reduce along with the last chunk's gradients (an elastic
        job's commit, DDP's ``carry``; read them back with ``ddp.carried()``)."""
        x, y = self.split(x, "input"), self.split(y, "target")
        if self.stage is None:
            net = self.ddp if self.ddp is not None else self.module
            ride = None if carry is None else (lambda loss: self.ddp.carry(carry(loss)))
            total = accumulate_gradients(net, self.loss_fn, x, y, accum_steps, before_last_backward=ride)
            if self.expert_params:
                reduce_expert_gradients(self.expert_params, self.topo.edp_group, self.topo.dp * self.topo.cp)
            return total
        if accum_steps != 1 or carry is not None:
            raise ConfigError(f"ParallelModel.train_step: a pipeline accumulates over its {self.microbatches} "
                              f"micro-batches; accum_steps must be 1 and carry None (got {accum_steps}, {carry!r})")
        # ZeRO reduces once per step for stage 1, and for stage 2 when the schedule splits the
        # backward (zb-h1's W passes accumulate weight gradients outside autograd, where no
        # hook sees them); else stage 2 reduce-scatters per micro-batch, from the hooks
        once = self.zero is not None and (self.zero.stage == 1 or self.schedule in SPLIT_BACKWARD)
        sync = (self.ddp.no_sync() if self.ddp is not None else self.zero.no_sync() if once
                else contextlib.nullcontext())
        first, last = self.stage.is_first, self.stage.is_last
        with sync:
            if isinstance(self.stage, InterleavedStage):
                loss = interleaved_step(self.stage, x if first else None, y if last else None,
                                        self.loss_fn if last else None, num_microbatches=self.microbatches)
            else:
                loss = pipeline_step(self.stage, x if first else None, y if last else None, self.loss_fn,
                                     schedule=self.schedule, num_microbatches=self.microbatches)
        if self.ddp is not None:
            self.ddp.allreduce_gradients()
        if once:
            self.zero.reduce_gradients()
        return loss

    @property
    def comm_wait_s(self) -> float | None:
        return self.ddp.comm_wait_s if self.ddp is not None else None


def parallelize(model: nn.Module, topo: Topology, *, loss_fn: Loss, tp_plan=None, algorithm: str = "native",
                microbatches: int = 1, schedule: str = "1f1b", virtual_stages: int = 2, bucket_cap_mb: float = 25.0,
                zero_stage: int = 0, optimizer=None, cp_plan: CPPlan | None = None,
                cp_algorithm: str = "ring", ep_plan: EPPlan | None = None,
                compression: str | None = None, tp_chunks: int | None = None) -> ParallelModel:
    """Apply ``tp_plan`` on ``topo.tp_group``, ``cp_plan`` on ``topo.cp_group`` (``cp_algorithm``:
    "ring" or "all-to-all"), ``ep_plan`` on ``topo.ep_group`` (the mixture layers' experts; with ep = 1 it
    only sums the router's counts over dp x cp), cut the pipeline stage of ``topo.pp_rank``, wrap it in DDP over
    ``topo.dp_cp_group`` (or ZeRO ``zero_stage`` with the ``optimizer`` factory); ``compression`` (None,
    "bf16", "fp16") is DDP's gradient compression on the wire. ``tp_chunks`` (``--layout-invariant``):
    the plan is applied even with tp = 1, its layers computing every split sum as that many fixed chunks
    in a fixed tree (:mod:`distrain.parallel.tensor_parallel.invariant`), the same bits on any tp dividing it. ``schedule``: "gpipe", "1f1b", "zb-h1"
    (:func:`pipeline_step` on a :class:`PipelineStage`) or "interleaved" (:func:`interleaved_step` on an
    :class:`InterleavedStage` holding ``virtual_stages`` chunks: the layers cut into pp x virtual_stages
    parts, chunk c of rank r the part c*pp + r).
    ``loss_fn(output, target)``: the loss on the model's full output (a plan that keeps the
    output sharded brings its own loss on shards, used when tp > 1).

    Ownership: call it inside a rank, on that rank's own model (built there, or a copy).
    ``model`` is changed in place (its layers are replaced by this rank's shards, like torch's
    ``parallelize_module``), so a model shared between processes (one passed through
    multiprocessing lives in shared memory) must be copied first: ``copy.deepcopy(model)``."""
    if not callable(loss_fn):
        raise ConfigError(f"parallelize: loss_fn must be a callable (output, target) -> loss, got {loss_fn!r}")
    check_zero_layout(zero_stage, topo.dp, topo.pp, topo.cp)
    if zero_stage and not callable(optimizer):
        raise ConfigError("parallelize: zero_stage needs optimizer= (a factory: lambda params: "
                          "torch.optim.AdamW(params, lr=1e-3)); ZeRO builds it over this rank's shards")
    if topo.tp > 1 and tp_plan is None:
        raise ConfigError(f"parallelize: tp={topo.tp} needs tp_plan= (module name -> 'colwise' / 'rowwise' / "
                          f"'vocab'); the GPT's is distrain.models.gpt.plan.gpt_tp_plan()")
    if topo.cp > 1 and cp_plan is None:
        raise ConfigError(f"parallelize: cp={topo.cp} needs cp_plan= (the modules that read the sequence layout); the "
                          f"GPT's is distrain.models.gpt.plan.gpt_cp_plan()")
    if topo.ep > 1 and ep_plan is None:
        raise ConfigError(f"parallelize: ep={topo.ep} needs ep_plan= (the mixture-of-experts layers); the Llama's is "
                          f"distrain.models.llama.plan.llama_ep_plan()")
    check_ep_layout(topo.ep, tp=topo.tp, pp=topo.pp, zero_stage=zero_stage)
    plan = as_plan(tp_plan) if tp_plan is not None else None
    # 0. the pipeline cut is decided on the whole model, before any sharding: the same on
    #    every rank whatever tp is (layers per stage, balanced by parameter count)
    interleaved = topo.pp > 1 and schedule == "interleaved"
    parts = topo.pp * virtual_stages if interleaved else topo.pp
    cut = [stop - start for start, stop in partition(model, parts)] if topo.pp > 1 else None
    # 1. tensor parallel: shards inside every layer, on the tp group
    tp = None
    if tp_chunks and plan is not None:
        tp = TPGroup(topo.tp_group, algorithm, chunks=tp_chunks) if topo.tp > 1 else TPGroup.alone(chunks=tp_chunks)
        apply_tensor_parallel(model, tp, plan=plan)
    elif topo.tp > 1:
        apply_tensor_parallel(model, topo.tp_group, algorithm, plan=plan)
    # 2. context parallel: positions and attention of this rank's part of the sequence, on the cp group
    cp = None
    if topo.cp > 1:
        cp = ContextParallel(topo.cp_group, cp_algorithm)
        apply_context_parallel(model, cp, plan=cp_plan)
    # 2b. expert parallel: this rank's experts, tokens to the others' by all-to-all, on the ep group
    ep = None
    if ep_plan is not None and (topo.ep > 1 or topo.dp * topo.cp > 1) and ep_plan.layers(model):
        ep = ExpertParallel(topo.ep_group, topo.dp_cp_group if topo.dp * topo.cp > 1 else None)
        apply_expert_parallel(model, ep, plan=ep_plan)
    experts = expert_parameter_names(model) if topo.ep > 1 else []
    if experts:  # they differ between the dp x cp ranks: DDP leaves them to reduce_expert_gradients
        model._ddp_params_and_buffers_to_ignore = experts
    # 3. pipeline: keep this stage's layers; neighbours are the same (dp, tp) on pp_rank -/+ 1
    if interleaved:  # chunks c*pp + r of the pp x virtual_stages parts (interleaved.py)
        stage = InterleavedStage.from_topology(model, topo, virtual_stages, balance=cut)
    else:
        stage = PipelineStage.from_topology(model, topo, balance=cut) if topo.pp > 1 else None
    module = stage if stage is not None else model
    # 4. data parallel: average the gradients of identical shards over the dp x cp group
    ddp = zero = None
    tp_info = tp_shard_info(module)
    if zero_stage:
        from distrain.parallel.zero import Zero

        if zero_stage == 3 and any(is_sequence_parallel(p) for p in module.parameters()):
            raise ConfigError("parallelize: ZeRO stage 3 does not compose with sequence parallelism: the hooks that sum "
                              "the sequence-parallel parameters' gradients over tp sit on the parameters stage 3 "
                              "replaces by gathered views; use zero_stage 1 or 2, or a plan without "
                              "sequence_parallel")
        zero = Zero(module, optimizer, stage=zero_stage, group=topo.dp_cp_group, algorithm=algorithm,
                    bucket_cap_mb=bucket_cap_mb)
    elif topo.dp * topo.cp > 1:
        ddp = DistributedDataParallel(module, group=topo.dp_cp_group, algorithm=algorithm,
                                      bucket_cap_mb=bucket_cap_mb, compression=compression)
    params = dict(module.named_parameters())
    return ParallelModel(topo, module, stage, ddp, algorithm, microbatches, schedule, loss_fn, plan, zero, tp_info,
                         cp, cp_plan if cp is not None else None, ep, [params[n] for n in experts], tp)


def check_zero_layout(zero_stage: int, dp: int, pp: int, cp: int = 1) -> None:
    """The rules for ZeRO inside the dp x cp x tp x pp grid (the trainer's config checks them too,
    before any rank starts): a stage of 0-3; at least 2 ranks in the dp x cp group to shard over;
    no stage 3 with a pipeline."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"parallelize: zero_stage must be 0 (DDP), 1, 2 or 3, got {zero_stage!r}")
    if zero_stage and dp * cp < 2:
        raise ConfigError(f"ZeRO stage {zero_stage} (--strategy zero{zero_stage}) shards over the dp group, but dp "
                          f"is {dp}: it needs dp >= 2 (or use --strategy ddp, which with dp 1 does nothing)"
                          + (f"; with --cp {cp} it shards over dp x cp" if cp > 1 else ""))
    if zero_stage == 3 and pp > 1:
        raise ConfigError(f"ZeRO stage 3 (--strategy zero3) does not compose with pipeline parallelism (--pp {pp}): "
                          f"it would all-gather every layer twice per micro-batch; use zero1 or zero2 with --pp > 1")
