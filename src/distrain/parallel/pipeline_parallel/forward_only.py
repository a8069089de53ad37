"""The forward-only pipeline schedule: evaluation (validation loss, accuracy) through the stages.

Training runs F and B (and W) ops per micro-batch (:func:`.pipeline.pipeline_step`,
:func:`.interleaved.interleaved_step`); evaluation needs only the F ops. :func:`forward_only`
runs them on a :class:`~.pipeline.PipelineStage` or an :class:`~.interleaved.InterleavedStage`,
whatever schedule it trains with (GPipe, 1F1B and ZB-H1 differ only in where the backward
goes, so without a backward they are one schedule; an interleaved stage runs its chunks in
Megatron's forward order). Micro-batches flow first stage -> last stage: each stage receives
activation k from the previous one (the tag ``stage.tag(k, "act")`` that training uses; the
training step has waited for all its messages before it returns, so nothing of it is in
flight), runs its layers, and sends the output on; the last stage hands its output and the
targets to ``loss_fn`` (any scoring function: a loss, or a row of statistics such as
[loss, correct, count]) and keeps what it returns. No gradient travels back.

What it does not touch (so that training after an evaluation computes what it would have
computed without one -- the tests compare whole training runs):

* autograd: every forward runs under ``torch.no_grad()``: no graph, nothing saved, no
  ``.grad`` written, no ZeRO reduce hook fired;
* module modes: the stage's modules are put in eval mode (dropout off, norms on running
  statistics) and each gets its own previous ``training`` flag back afterwards, also on error;
* random numbers: the CPU generator and the stage's CUDA device's are saved and restored
  (``torch.random.fork_rng``), so a layer that draws in eval mode takes nothing from training's
  streams;
* ``stage.timeline`` (the last training step's record, for ``--trace`` / ``--gantt``): no
  timeline is made or replaced. Messages go into the ledger under the label ``"pp-eval"``,
  apart from training's ``"pp"``.

Why it cannot deadlock. A plain stage runs micro-batches 0..m-1 in order and keeps at most
``MAX_SENDS_IN_FLIGHT`` sends pending: before sending activation k it waits until the send of
k - MAX_SENDS_IN_FLIGHT has completed (its receiver has posted the receive), which bounds the
activations a fast stage holds for a slow successor. Op (s, k) waits only for op (s-1, k)
(its input), op (s, k-1) (program order) and op (s+1, k-W-1) (stage s+1 posts receive k-W
after finishing k-W-1): every wait is for an op earlier in the order (k, s), so the waits
form no cycle. An interleaved stage's chunks go round the ring of ranks (rank p-1 feeds rank
0's next chunk), where bounded sends could deadlock (rank 0 running chunk 0 ahead while rank
p-1 waits to hand it chunk 1's inputs), so there every send is non-blocking and only receives
block -- a Kahn network, as in training -- and the order is Megatron's: micro-batches in
groups of p, each group through chunk 0, then chunk 1, ... Op (c, k) sits at the same place in
every rank's program (index i), and rank r's op i waits only for rank r-1's op i (r > 0) or
rank p-1's op i - g (r = 0, chunk c - 1, g = the group's size), so the order ``i * p + r``
completes every program: one complete execution, hence no deadlock, whatever the timing.

Contract: every rank of the pipeline calls ``forward_only`` equally often with the same
``num_microbatches`` (``DISTRAIN_DEBUG=1`` checks it along the chain); with tensor parallelism
the tp ranks of a stage call it together (their collectives inside the layers meet as in
training). The stage's parameters are what the optimizer left (DDP and ZeRO stages 1-2 keep
the full parameters in the stage's modules; ZeRO-3, which gathers them in forward hooks on
the modules, is refused with a pipeline by ``parallelize``).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch
import torch.nn as nn

from distrain import comm
from distrain.comm.core.util import check_int
from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel.interleaved import InterleavedStage
from distrain.parallel.pipeline_parallel.pipeline import PipelineStage, as_microbatches

__all__ = ["MAX_SENDS_IN_FLIGHT", "evaluation_mode", "forward_only"]

LABEL = "pp-eval"  # the ledger's label of evaluation messages (training's are "pp")
MAX_SENDS_IN_FLIGHT = 2  # per plain stage: one activation on the wire while the next is computed


def _device(module: nn.Module) -> torch.device | None:
    return next((q.device for q in module.parameters()), None)


@contextlib.contextmanager
def evaluation_mode(module: nn.Module, device: torch.device | None = None):
    """``torch.no_grad()``, ``module`` in eval mode, and the random generators saved: the CPU's and
    that of ``device`` when it is a CUDA device (default: the device of ``module``'s parameters;
    pass it for a module whose parameters live elsewhere, e.g. with ZeRO-3). On exit each
    submodule gets its own ``training`` flag back and the generators their state, also when the
    body raised."""
    modes = [(m, m.training) for m in module.modules()]
    device = device if device is not None else _device(module)
    cuda = [device] if device is not None and device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda), torch.no_grad():
            module.eval()
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def forward_only(stage: PipelineStage | InterleavedStage, micro_inputs=None, micro_targets=None,
                 loss_fn: Callable | None = None, *, num_microbatches: int) -> list[torch.Tensor] | None:
    """The forwards of ``num_microbatches`` micro-batches through the pipeline, no backward (module doc).

    ``micro_inputs``: first stage only (rank 0 of an interleaved pipeline), the batch (B, ...)
    cut here into m equal micro-batches (ConfigError if m does not divide B) or a list of m
    micro-batches (any sizes: each is scored on its own). ``micro_targets`` and
    ``loss_fn(output, target) -> tensor``: last stage only, likewise; the others pass None.
    Returns on the last stage the m values ``loss_fn`` returned, detached, in micro-batch
    order (combining them -- e.g. averaging equal micro-batches' mean losses -- is the
    caller's); None elsewhere. Under ``evaluation_mode(stage)``: no autograd, eval mode,
    random generators and module modes restored, ``stage.timeline`` untouched.
    """
    m = num_microbatches
    if isinstance(stage, InterleavedStage):
        first, last, where = stage.rank == 0, stage.rank == stage.num_stages - 1, f"rank {stage.rank}"
        check_int(m, "num_microbatches", "forward_only", 1)
    elif isinstance(stage, PipelineStage):
        first, last, where = stage.is_first, stage.is_last, f"stage {stage.stage_index}"
        check_int(m, "num_microbatches", "forward_only", 1, stage.max_microbatches() + 1)
    else:
        raise ConfigError(f"forward_only: expected a PipelineStage or an InterleavedStage, got "
                          f"{type(stage).__name__}; for a whole model call it directly under evaluation_mode(model)")
    where = f"forward_only: {where} of {stage.num_stages}"
    if first == (micro_inputs is None):
        fix = "holds the first layers: pass micro_inputs" if first else \
            "does not hold the first layers: pass micro_inputs=None"
        raise ConfigError(f"{where} {fix}")
    if last == (micro_targets is None) or (last and loss_fn is None):
        fix = "holds the last layers: pass micro_targets and loss_fn" if last else \
            "does not hold the last layers: pass micro_targets=None"
        raise ConfigError(f"{where} {fix}")
    xs = as_microbatches(micro_inputs, m, "batch") if first else None
    ys = as_microbatches(micro_targets, m, "batch of targets") if last else None
    if comm.debug_enabled():
        _check_agreement(stage, m)
    with evaluation_mode(stage):
        if isinstance(stage, InterleavedStage):
            return _run_interleaved(stage, xs, ys, loss_fn, m)
        return _run_plain(stage, xs, ys, loss_fn, m)


def _run_plain(stage: PipelineStage, xs, ys, loss_fn, m: int) -> list[torch.Tensor] | None:
    device, scores = _device(stage), []
    sends: list[list] = []  # per sent micro-batch, in order: [(work, tensor)] (header, payload)
    for k in range(m):
        if stage.is_first:
            x = xs[k]  # (B/m, ...) e.g. ids (B/m, T)
        else:
            x = comm.recv_tensor(stage.prev_rank, stage.group, stage.tag(k, "act"), device=device, label=LABEL)
        out = stage(x)  # e.g. hidden (B/m, T, C), or logits (B/m, T, V) on the last stage
        if stage.is_last:
            scores.append(_detached(loss_fn(out, ys[k])))
            continue
        while len(sends) >= MAX_SENDS_IN_FLIGHT:  # bounded: see the module doc for why this cannot deadlock
            for w, _ in sends.pop(0):
                w.wait()
        sends.append(comm.isend_tensor(out, stage.next_rank, stage.group, stage.tag(k, "act"), label=LABEL))
    for pending in sends:
        for w, _ in pending:
            w.wait()
    return scores if stage.is_last else None


def _interleaved_order(p: int, v: int, m: int) -> list[tuple[int, int]]:
    """(chunk, micro-batch) in Megatron's forward order: groups of p micro-batches (the last one
    smaller when p does not divide m), each group through chunk 0, then chunk 1, ..."""
    return [(c, k) for g in range(0, m, p) for c in range(v) for k in range(g, min(g + p, m))]


def _run_interleaved(stage: InterleavedStage, xs, ys, loss_fn, m: int) -> list[torch.Tensor] | None:
    p, r, v = stage.num_stages, stage.rank, stage.virtual_stages
    prev, nxt, device = stage.ranks[(r - 1) % p], stage.ranks[(r + 1) % p], _device(stage)
    last_j = p * v - 1
    scores: dict[int, torch.Tensor] = {}
    local: dict[int, torch.Tensor] = {}  # p = 1: chunk c's output of micro-batch k feeds chunk c + 1 here
    pending: list = []  # [(work, tensor)] of posted sends, kept alive until complete
    for c, k in _interleaved_order(p, v, m):
        j = c * p + r  # virtual stage
        if j == 0:
            x = xs[k]
        elif p == 1:
            x = local.pop(k)
        else:
            x = comm.recv_tensor(prev, stage.group, stage.tag(j - 1, k, m, "act"), device=device, label=LABEL)
        out = stage.chunks[c](x)
        if j == last_j:
            scores[k] = _detached(loss_fn(out, ys[k]))
        elif p == 1:
            local[k] = out
        else:
            pending += comm.isend_tensor(out, nxt, stage.group, stage.tag(j, k, m, "act"), label=LABEL)
            pending = [(w, t) for w, t in pending if not w.is_completed()]
    for w, _ in pending:  # every matching receive is posted by now: each rank receives all it is sent
        w.wait()
    return [scores[k] for k in range(m)] if r == p - 1 else None


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach()
    raise ConfigError(f"forward_only: loss_fn must return a tensor (a loss, or a row of statistics), got "
                      f"{type(value).__name__}")


def _check_agreement(stage, m: int) -> None:
    """Debug: each rank receives num_microbatches from the previous one along the chain of
    stages, compares, passes its own on (tag_base + 1: no forward-only message uses it)."""
    if isinstance(stage, InterleavedStage):
        r, p = stage.rank, stage.num_stages
        prev = stage.ranks[r - 1] if r > 0 else None
        nxt = stage.ranks[r + 1] if r < p - 1 else None
        who = f"rank {r}"
    else:
        prev, nxt, who = stage.prev_rank, stage.next_rank, f"stage {stage.stage_index}"
    mine = torch.tensor([m], dtype=torch.int64)
    if prev is not None:
        theirs = comm.recv_tensor(prev, stage.group, stage.tag_base + 1, label=LABEL)
        if not torch.equal(theirs, mine):
            raise ConfigError(f"forward_only: {who} was called with num_microbatches={m} but its predecessor "
                              f"(rank {prev}) with num_microbatches={int(theirs[0])}; every stage must use the "
                              f"same value")
    if nxt is not None:
        comm.send_tensor(mine, nxt, stage.group, stage.tag_base + 1, label=LABEL)
