"""Pipeline parallelism with micro-batches: GPipe and 1F1B, on distrain.comm point-to-point.

The model's ``layers`` list is cut into ``p`` contiguous stages, one per rank of a pipeline
(:func:`partition`, balanced by parameter count); each rank holds a :class:`PipelineStage`
(an ``nn.Module`` with only its layers, so an optimizer or a data-parallel wrapper takes its
parameters). :func:`pipeline_step` splits the batch into ``m`` micro-batches and runs the
forward and backward of all of them; activations travel forward and their gradients
backward with ``isend``/``recv_tensor`` (a header carries dtype and shape), label ``"pp"``
in the ledger. Pure parts (partition, schedules, simulation) are in ``schedule``, timelines
and traces in ``timeline``; the package ``distrain.parallel.pipeline_parallel`` exports all.

Contract
--------
* Every rank of a pipeline calls ``pipeline_step`` the same number of times, with the same
  ``num_microbatches`` and ``schedule`` (``DISTRAIN_DEBUG=1`` checks this along the chain).
* The first stage passes the inputs (B, ...) -- or a list of m micro-batches -- the last
  stage the targets and ``loss_fn(output, target) -> scalar``; the others pass None.
* Gradients accumulate into ``.grad`` (call ``optimizer.zero_grad()`` before the step).
  Each micro-batch's loss is scaled by 1/m, so with a mean loss over equal micro-batches
  the accumulated gradients are those of the full batch. The last stage returns the mean
  of the micro-batch losses (a detached scalar tensor); the other stages return None.

Schedules (p = 3 stages, m = 4 micro-batches, one column = one op of unit time)
------------------------------------------------------------------------------
GPipe (Huang et al., "GPipe", NeurIPS 2019): all forwards, then all backwards::

    stage 0:  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1:  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2:  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

1F1B (PipeDream-Flush: Narayanan et al., "PipeDream", SOSP 2019; "Memory-Efficient
Pipeline-Parallel DNN Training", ICML 2021; the schedule of Megatron-LM, SC 2021): stage s
runs w = min(p - s - 1, m) warm-up forwards, then alternates one forward and one backward,
then drains the last w backwards::

    stage 0:  F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1:  .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    stage 2:  .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

Both have the same bubble -- with equal stages and free communication each stage idles
(p - 1) forward + backward slots of the m + p - 1 the step takes, so the idle fraction is

    bubble = (p - 1) / (m + p - 1)        (here 2 / 6)

-- but GPipe holds the activations of all m micro-batches at the end of its forwards, 1F1B
at most min(p - s, m) on stage s: memory bounded by p instead of m.

ZB-H1 (``schedule="zb-h1"``, Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024):
the backward is split into B (input gradient, sent on at once) and W (weight gradients,
:mod:`.weight_grad`), and W passes fill the cool-down; with T_F = T_B = T_W the bubble is
(p - 1) / (3m + p - 1), a third of 1F1B's idle time, at 1F1B's peak memory (order and
proof in :mod:`.zero_bubble`). W sends and receives nothing, so the argument below holds.

Why it cannot deadlock
----------------------
On Gloo a ``send`` is a rendezvous: it returns only once the receiver has posted the
matching receive (measured here: a 1-element send waits the full second its peer sleeps
before receiving). With blocking sends 1F1B deadlocks already at p=2, m=2: stage 0 blocks in
send(act 1) while stage 1, having run F0 and B0, blocks in send(grad 0); each waits for the
other to post a receive (``simulate(..., blocking_sends=True)`` finds exactly this). So:

1. Every send is posted with ``isend`` (header, then payload, same tag) and is *not* waited on
   during the step: the tensors stay alive in a pending list, pruned as sends complete, and
   the rest are waited for at the end of the step -- by then every receive has been posted,
   since each stage's program receives every message its neighbours send it.
2. A receive blocks, from a fixed peer, on a tag naming the micro-batch and the direction
   (activation k: ``tag_base + 2 + 2k``, its gradient: ``tag_base + 3 + 2k``), so messages
   cannot be confused whatever order they arrive in.
3. The only blocking operation is then a receive. Stages are sequential processes with
   blocking reads on fixed channels and non-blocking writes -- a Kahn process network -- so
   whether they deadlock does not depend on timing: one complete execution order suffices.
   The unit-time schedules above are one: each receive's message comes from an op in an
   earlier column. In words, for 1F1B: before stage s waits for grad j it has sent
   activations 0..j+p-s-1, while stage s+1 needs only activations 0..j+p-s-2 to produce
   grad j; before stage s+1 waits for activation k it has waited only for grads
   j <= k-p+s+1, which stage s produces after sending activations 0..k-1, and activations
   < k do not depend on activation k. ``simulate`` checks every p <= 8, m <= 16 in the tests.

Composition
-----------
``PipelineStage.from_topology(model, topo)`` takes the stage ``topo.pp_rank``, its neighbours
``topo.pp_prev`` / ``topo.pp_next`` (same dp and tp coordinates: tp rank t of stage i talks to
tp rank t of stage i+1) and sends on ``topo.pp_group``. Tensor parallelism: the tp ranks of a
stage run the same program, so their collectives inside F/B are reached in the same order (a
stage's tp group behaves as one process in the argument above); partition the *unsharded*
model or pass ``balance=[...]`` so that every tp rank cuts at the same layers. Data
parallelism: after ``pipeline_step`` all-reduce (average) the stage's gradients over
``topo.dp_group``, then step the optimizer (tested for dp=2 x pp=2).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn as nn

from distrain import comm
from distrain.comm.core import tags
from distrain.comm.core.util import check_int, nbytes
from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel.schedule import SCHEDULES, SPLIT_BACKWARD, check_schedule, partition, \
    schedule_ops, split_microbatches
from distrain.parallel.pipeline_parallel.timeline import StageTimeline
from distrain.parallel.pipeline_parallel.weight_grad import WeightGradStore, check_no_autocast, defer_weight_grads

__all__ = ["DEFAULT_TAG_BASE", "MicrobatchHooks", "PipelineStage", "pipeline_step"]

DEFAULT_TAG_BASE = tags.PIPELINE.start  # pipeline tags: [tag_base, PIPELINE.stop), see distrain.comm.core.tags
LABEL = "pp"


class PipelineStage(nn.Module):
    """Stage ``stage_index`` of ``num_stages``: the contiguous slice of the model's layers it runs.

    ``model_or_layers``: a model with ``.layers`` (GPT, MLP) or a list of modules; the stage
    keeps references to its own layers only (drop the model afterwards to free the rest).
    ``prev_rank`` / ``next_rank``: global ranks of the neighbouring stages (None on the first
    / last stage). ``group``: the process group the messages use (None: the world; the ranks
    stay global either way). ``balance``: see :func:`partition`.
    """

    def __init__(self, model_or_layers, stage_index: int, num_stages: int, prev_rank: int | None = None,
                 next_rank: int | None = None, *, balance="params", group=None,
                 tag_base: int = DEFAULT_TAG_BASE, name: str = "the model"):
        super().__init__()
        bounds = partition(model_or_layers, num_stages, balance, name=name)
        check_int(stage_index, "stage_index", "PipelineStage", 0, num_stages)
        first, last = stage_index == 0, stage_index == num_stages - 1
        for what, rank, none in (("prev_rank", prev_rank, first), ("next_rank", next_rank, last)):
            if none and rank is not None:
                raise ConfigError(f"PipelineStage: stage {stage_index} of {num_stages} has no "
                                  f"{'previous' if what == 'prev_rank' else 'next'} stage; pass {what}=None")
            if not none and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 0):
                raise ConfigError(f"PipelineStage: stage {stage_index} of {num_stages} needs {what} "
                                  f"(a global rank), got {rank!r}")
        check_int(tag_base, "tag_base", "PipelineStage", 0, tags.PIPELINE.stop - 3)
        all_layers = model_or_layers.layers if hasattr(model_or_layers, "layers") else list(model_or_layers)
        self.stage_index, self.num_stages = stage_index, num_stages
        self.prev_rank, self.next_rank = prev_rank, next_rank
        self.group, self.tag_base = group, tag_base
        self.bounds = bounds  # every stage's (start, stop) in the model's layer list
        self.start, self.stop = bounds[stage_index]
        self.layers = nn.ModuleList(all_layers[self.start:self.stop])
        self.timeline: StageTimeline | None = None  # the last step's record

    @classmethod
    def from_topology(cls, model_or_layers, topo, **kwargs) -> "PipelineStage":
        """The stage of ``topo.pp_rank``, neighbours ``topo.pp_prev`` / ``topo.pp_next`` (the same
        dp and tp coordinates), messages on ``topo.pp_group`` when the topology has groups."""
        try:
            group = topo.pp_group
        except ConfigError:  # a pure Topology: the default group, global ranks
            group = None
        kwargs.setdefault("group", group)
        return cls(model_or_layers, topo.pp_rank, topo.pp, topo.pp_prev, topo.pp_next, **kwargs)

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def tag(self, k: int, channel: str) -> int:
        """P2P tag of micro-batch ``k``'s activation ("act") or gradient ("grad")."""
        return self.tag_base + 2 + 2 * k + (channel == "grad")

    def max_microbatches(self) -> int:
        return (tags.PIPELINE.stop - self.tag_base - 2) // 2


class MicrobatchHooks:
    """What a caller does around each micro-batch (``pipeline_step(..., hooks=)``, ``interleaved_step``): the
    layout-invariant step (distrain.parallel.invariant.pipeline), whose micro-batches are its units of work.

    With hooks the step changes in three ways, and only then: the last stage's loss is not scaled by 1/m (each
    micro-batch's gradient is its own loss's, as one process's unit); the random generator's state travels
    with each activation (the first stage seeds it in :meth:`forward`, every later stage continues from the
    state the previous one left, so a micro-batch draws what one process's whole forward would); the methods
    below are called. Subclass and override."""

    def forward(self, k: int) -> None:
        """Before the first stage's forward of micro-batch k (seed the generator here)."""

    def loss(self, k: int, loss: torch.Tensor) -> None:
        """The last stage's unscaled loss of micro-batch k (a scalar with its graph)."""

    def grads(self, k: int, complete: bool) -> None:
        """After an op that left micro-batch k's parameter gradients in ``.grad`` (a backward, a chunk's
        backward, ZB-H1's B or W); ``complete``: the last such op of micro-batch k on this rank."""


def send_rng(dst: int, group, tag: int) -> list:
    """Non-blocking send of this process's CPU generator state on ``tag`` (after the activation on the
    same tag: messages between two ranks on one tag arrive in order)."""
    return comm.isend_tensor(torch.get_rng_state(), dst, group, tag, label=LABEL)


def recv_rng(src: int, group, tag: int) -> None:
    """Continue from the generator state that :func:`send_rng` sent."""
    torch.set_rng_state(comm.recv_tensor(src, group, tag, label=LABEL))


def _isend_tensor(t: torch.Tensor, dst: int, group, tag: int) -> list:
    """Non-blocking send of a self-describing tensor; the caller keeps the list until done."""
    return comm.isend_tensor(t, dst, group, tag, label=LABEL)


def _nbytes(t) -> int:
    return nbytes(t) if isinstance(t, torch.Tensor) else 0


def as_microbatches(value, m: int, what: str) -> list:
    """``value`` as m micro-batches: a tensor (B, ...) split along dim 0, or a list of m taken as it is."""
    if isinstance(value, torch.Tensor):
        return split_microbatches(value, m, what=what)
    if isinstance(value, (list, tuple)):
        if len(value) != m:
            raise ConfigError(f"{what}: got a list of {len(value)} micro-batches but num_microbatches={m}")
        return list(value)
    raise ConfigError(f"{what} must be a tensor (B, ...) or a list of {m} micro-batches, got {type(value).__name__}")


def _check_agreement(stage: PipelineStage, m: int, schedule: str) -> None:
    """Debug: each stage receives (m, schedule) from the previous one, compares, passes its own on."""
    mine = torch.tensor([m, SCHEDULES.index(schedule)], dtype=torch.int64)
    if not stage.is_first:
        theirs = comm.recv_tensor(stage.prev_rank, stage.group, stage.tag_base, label=LABEL)
        if not torch.equal(theirs, mine):
            raise ConfigError(
                f"pipeline_step: stage {stage.stage_index} (rank {_global_rank()}) was called with "
                f"num_microbatches={m}, schedule={schedule!r} but stage {stage.stage_index - 1} "
                f"(rank {stage.prev_rank}) with num_microbatches={int(theirs[0])}, "
                f"schedule={SCHEDULES[int(theirs[1])]!r}; every stage must use the same values")
    if not stage.is_last:
        comm.send_tensor(mine, stage.next_rank, stage.group, stage.tag_base, label=LABEL)


def pipeline_step(stage: PipelineStage, micro_inputs=None, micro_targets=None, loss_fn=None, *,
                  schedule: str = "1f1b", num_microbatches: int,
                  hooks: MicrobatchHooks | None = None) -> torch.Tensor | None:
    """Forward and backward of ``num_microbatches`` micro-batches through the pipeline (see the module doc).

    ``micro_inputs``: first stage only, the batch (B, ...) split here into m micro-batches of
    (B/m, ...) (ConfigError if m does not divide B), or a list of m micro-batches.
    ``micro_targets`` and ``loss_fn(output, target)``: last stage only, likewise.
    Returns the mean micro-batch loss on the last stage, None elsewhere; ``stage.timeline``
    then holds this step's :class:`StageTimeline` (for :func:`collect_timeline`). ``hooks``: see
    :class:`MicrobatchHooks` (None: the plain step).
    """
    m, p, s = num_microbatches, stage.num_stages, stage.stage_index
    check_schedule(schedule)
    check_int(m, "num_microbatches", "pipeline_step", 1, stage.max_microbatches() + 1)
    if stage.is_first == (micro_inputs is None):
        raise ConfigError(f"pipeline_step: stage {s} of {p} " + (
            "is the first stage: pass micro_inputs" if stage.is_first
            else "is not the first stage: pass micro_inputs=None"))
    if stage.is_last == (micro_targets is None) or (stage.is_last and loss_fn is None):
        raise ConfigError(f"pipeline_step: stage {s} of {p} " + (
            "is the last stage: pass micro_targets and loss_fn" if stage.is_last
            else "is not the last stage: pass micro_targets=None"))
    inputs = as_microbatches(micro_inputs, m, "batch") if stage.is_first else None
    targets = as_microbatches(micro_targets, m, "batch of targets") if stage.is_last else None
    if comm.debug_enabled():
        _check_agreement(stage, m, schedule)

    if schedule in SPLIT_BACKWARD:
        check_no_autocast()
    run = _StepRun(stage, schedule, m, inputs, targets, loss_fn, hooks)
    for kind, k in schedule_ops(schedule, p, s, m):
        {"F": run.forward, "B": run.backward, "W": run.weight}[kind](k)
        run.tl.note_held(run.in_flight, run.saved_bytes + run.store.held_bytes())
        run.pending = [(w, t) for w, t in run.pending if not w.is_completed()]
    return run.finish()


class _StepRun:
    """The state one ``pipeline_step`` shares between its F, B and W ops."""

    def __init__(self, stage: PipelineStage, schedule: str, m: int, inputs, targets, loss_fn, hooks=None):
        self.stage, self.m, self.inputs, self.targets, self.loss_fn = stage, m, inputs, targets, loss_fn
        self.hooks = hooks
        self.split = schedule in SPLIT_BACKWARD  # ZB-H1: B leaves the linear layers' weight gradients to W
        self.store = WeightGradStore()  # stays empty unless split
        self.device = next((q.device for q in stage.parameters()), None)
        self.tl = stage.timeline = StageTimeline(stage=stage.stage_index, rank=_global_rank(),
                                                 num_stages=stage.num_stages, schedule=schedule, num_microbatches=m)
        self.saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # k -> (stage input, output or scaled loss)
        self.saved_bytes = self.in_flight = 0  # in flight: forwarded, not yet through B (split: through W)
        self.pending: list = []  # [(work, tensor)] of posted sends, kept alive until complete
        self.losses: list[torch.Tensor] = []

    def _recv(self, peer: int, k: int, channel: str) -> torch.Tensor:
        stage, t0 = self.stage, time.perf_counter()
        x = comm.recv_tensor(peer, stage.group, stage.tag(k, channel), device=self.device, label=LABEL)
        self.tl.add_wait("recv_" + channel, k, t0, time.perf_counter())
        return x

    def forward(self, k: int) -> None:
        stage = self.stage
        hooks = self.hooks
        if stage.is_first:
            x = self.inputs[k]  # (B/m, ...) e.g. ids (B/m, T)
            if hooks is not None:
                hooks.forward(k)
        else:
            x = self._recv(stage.prev_rank, k, "act")
            if not x.is_floating_point():
                raise ConfigError(f"pipeline stage {stage.stage_index} received a {x.dtype} activation; only the "
                                  "first stage may take non-floating inputs (move the cut after the embedding)")
            x.requires_grad_()  # a leaf: its .grad is what goes back to stage s-1
            if hooks is not None:
                recv_rng(stage.prev_rank, stage.group, stage.tag(k, "act"))
        t0 = time.perf_counter()
        with defer_weight_grads(self.store, k) if self.split else contextlib.nullcontext():
            out = stage(x)  # e.g. hidden (B/m, T, C), or logits (B/m, T, V) on the last stage
            if stage.is_last:
                loss = self.loss_fn(out, self.targets[k])
                self.losses.append(loss.detach())
                if hooks is None:
                    out = loss / self.m  # scaled: the m backwards sum to the full batch's gradient
                else:
                    hooks.loss(k, loss)
                    out = loss
        self.tl.add("F", k, t0, time.perf_counter())
        self.in_flight += 1
        if not stage.is_last:
            self.pending += _isend_tensor(out, stage.next_rank, stage.group, stage.tag(k, "act"))
            if hooks is not None:
                self.pending += send_rng(stage.next_rank, stage.group, stage.tag(k, "act"))
        self.saved[k] = (x, out)
        self.saved_bytes += _nbytes(x) + _nbytes(out)

    def backward(self, k: int) -> None:
        """The whole backward of micro-batch k, or under ZB-H1 its input-gradient part B."""
        stage = self.stage
        grad = None if stage.is_last else self._recv(stage.next_rank, k, "grad")  # shape of out: (B/m, T, C)
        x, out = self.saved.pop(k)
        t0 = time.perf_counter()
        if out.requires_grad:  # False only for a first stage without parameters
            # split: in the block too, so that activation checkpointing recomputes the split linears
            with defer_weight_grads(self.store, k) if self.split else contextlib.nullcontext():
                torch.autograd.backward(out, grad)
        self.tl.add("B", k, t0, time.perf_counter())
        if not stage.is_first:
            gx = x.grad if x.grad is not None else torch.zeros_like(x)
            self.pending += _isend_tensor(gx, stage.prev_rank, stage.group, stage.tag(k, "grad"))
        if self.hooks is not None:
            self.hooks.grads(k, not self.split)
        self.saved_bytes -= _nbytes(x) + _nbytes(out)
        self.in_flight -= not self.split

    def weight(self, k: int) -> None:
        """ZB-H1's W: the weight gradients of micro-batch k that its B deferred."""
        t0 = time.perf_counter()
        self.store.flush(k)
        self.tl.add("W", k, t0, time.perf_counter())
        if self.hooks is not None:
            self.hooks.grads(k, True)
        self.in_flight -= 1

    def finish(self) -> torch.Tensor | None:
        for w, _ in self.pending:  # every matching receive is posted by now (module doc, point 1)
            w.wait()
        if self.store.pending():  # the schedule runs one W per B; anything left would be a lost gradient
            raise AssertionError(f"pipeline_step: weight gradients of micro-batches {self.store.pending()} never ran")
        return torch.stack(self.losses).mean() if self.stage.is_last else None


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
