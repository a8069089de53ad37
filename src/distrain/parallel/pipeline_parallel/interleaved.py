"""Interleaved 1F1B: each rank holds v model chunks (virtual stages), the bubble shrinks v times.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC 2021), section 2.2.2. The layer list is cut into p*v contiguous chunks;
rank r holds chunks r, p + r, 2p + r, ... (virtual stages j = c*p + r, c = 0..v-1), so an
activation goes round the ring of ranks v times. With m micro-batches (a multiple of p) each
rank runs m*v forward and m*v backward ops of 1/v the cost, and the pipeline fills and drains
in (p - 1) chunk-times instead of (p - 1) stage-times:

    bubble time / ideal time = (p - 1) / (v * m)        (1F1B: (p - 1) / m)

Order on rank r (Megatron's): op k of the m*v forwards runs chunk (k mod p*v) // p on
micro-batch (k // p*v) * p + k mod p -- groups of p micro-batches go through chunk 0, then
chunk 1, ...; backwards walk the chunks in reverse. Rank r runs
w = min((p - r - 1) * 2 + (v - 1) * p, m*v) warm-up forwards, then alternates one forward and
one backward, then drains. Messages cross the boundary between virtual stages j and j + 1
(rank r to rank r + 1 mod p); the tag names the boundary, the micro-batch and the direction.
As in :mod:`.pipeline`, sends are ``isend`` and only receives block, so the ranks form a Kahn
network: :func:`simulate_interleaved` completing proves the executor cannot deadlock.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from distrain import comm
from distrain.comm.core import tags
from distrain.comm.core.util import check_int
from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel.pipeline import MicrobatchHooks, recv_rng, send_rng
from distrain.parallel.pipeline_parallel.schedule import ScheduleDeadlock, partition, split_microbatches
from distrain.parallel.pipeline_parallel.timeline import PipelineTimeline, StageTimeline

__all__ = ["InterleavedStage", "interleaved_bubble", "interleaved_ops", "interleaved_step", "simulate_interleaved"]

LABEL = "pp"


def _check(p: int, v: int, m: int) -> None:
    check_int(p, "num_stages", "interleaved 1F1B", 1)
    check_int(v, "virtual_stages", "interleaved 1F1B", 1)
    check_int(m, "num_microbatches", "interleaved 1F1B", 1)
    if m % p:
        raise ConfigError(f"interleaved 1F1B: num_microbatches={m} must be a multiple of the pipeline size p={p} "
                          f"(micro-batches go through each chunk in groups of p)")


def interleaved_ops(p: int, r: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Rank r's compute ops in order: [("F", chunk, micro-batch), ..., ("B", chunk, micro-batch)]."""
    _check(p, v, m)
    total = m * v

    def op(kind: str, k: int) -> tuple[str, int, int]:
        c = (k % (p * v)) // p
        return kind, (c if kind == "F" else v - 1 - c), (k // (p * v)) * p + k % p

    w = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
    ops = [op("F", k) for k in range(w)]
    for i in range(total - w):
        ops += [op("F", w + i), op("B", i)]
    ops += [op("B", k) for k in range(total - w, total)]
    return ops


def interleaved_bubble(p: int, v: int, m: int) -> float:
    """(p - 1) / (v * m): bubble time over ideal compute time (Narayanan et al. 2021, eq. 2.2.2)."""
    return (p - 1) / (v * m)


def _program(p: int, r: int, v: int, m: int) -> list[tuple]:
    """The ops of rank r with their receives and sends: ("recv"/"send", peer, channel, boundary, k)."""
    last = p * v - 1
    prog: list[tuple] = []
    for kind, c, k in interleaved_ops(p, r, v, m):
        j = c * p + r  # virtual stage
        if kind == "F":
            prog += [("recv", (r - 1) % p, "act", j - 1, k)] if j > 0 else []
            prog.append(("compute", "F", k))
            prog += [("send", (r + 1) % p, "act", j, k)] if j < last else []
        else:
            prog += [("recv", (r + 1) % p, "grad", j, k)] if j < last else []
            prog.append(("compute", "B", k))
            prog += [("send", (r - 1) % p, "grad", j - 1, k)] if j > 0 else []
    return prog


def simulate_interleaved(p: int, v: int, m: int, *, f_cost: float = 1.0, b_cost: float = 2.0) -> PipelineTimeline:
    """Play every rank's program with chunk ops of cost f_cost/v and b_cost/v and free, non-blocking
    sends; return the ideal timeline, or raise ScheduleDeadlock naming what each rank waits for."""
    progs = [_program(p, r, v, m) for r in range(p)]
    pc, clock = [0] * p, [0.0] * p
    sent: dict[tuple, float] = {}  # (channel, boundary, k) -> time available
    tls = [StageTimeline(stage=r, rank=r, num_stages=p, schedule=f"interleaved(v={v})", num_microbatches=m)
           for r in range(p)]
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pc[r] < len(progs[r]):
                a = progs[r][pc[r]]
                if a[0] == "compute":
                    cost = (f_cost if a[1] == "F" else b_cost) / v
                    tls[r].add(a[1], a[2], clock[r], clock[r] + cost)
                    clock[r] += cost
                elif a[0] == "recv":
                    if (a[2], a[3], a[4]) not in sent:
                        break
                    clock[r] = max(clock[r], sent.pop((a[2], a[3], a[4])))
                else:
                    sent[(a[2], a[3], a[4])] = clock[r]
                pc[r] += 1
                progress = True
    stuck = [f"rank {r} waits for {progs[r][pc[r]][2]} {progs[r][pc[r]][4]} across boundary {progs[r][pc[r]][3]}"
             for r in range(p) if pc[r] < len(progs[r])]
    if stuck:
        raise ScheduleDeadlock(f"interleaved 1F1B p={p} v={v} m={m} deadlocks: " + "; ".join(stuck))
    return PipelineTimeline(tls)


class InterleavedStage(nn.Module):
    """Rank ``rank`` of a pipeline of ``num_stages`` ranks, holding ``virtual_stages`` chunks:
    ``chunks[c]`` runs the layers of virtual stage c*p + rank. ``ranks``: the pipeline's global
    ranks in stage order (``topo.pp_ranks``); ``group``: the group the messages use."""

    def __init__(self, model_or_layers, rank: int, num_stages: int, virtual_stages: int, ranks, *,
                 balance="params", group=None, tag_base: int = tags.PIPELINE.start, name: str = "the model"):
        super().__init__()
        p, v = num_stages, virtual_stages
        check_int(rank, "rank", "InterleavedStage", 0, p)
        check_int(v, "virtual_stages", "InterleavedStage", 1)
        if len(ranks) != p:
            raise ConfigError(f"InterleavedStage: ranks must list the {p} global ranks of the pipeline, got {ranks}")
        bounds = partition(model_or_layers, p * v, balance, name=name)
        layers = model_or_layers.layers if hasattr(model_or_layers, "layers") else list(model_or_layers)
        self.rank, self.num_stages, self.virtual_stages = rank, p, v
        self.ranks, self.group, self.tag_base = list(ranks), group, tag_base
        self.bounds = [bounds[c * p + rank] for c in range(v)]  # chunk c's (start, stop) in the model's layers
        self.chunks = nn.ModuleList(nn.Sequential(*layers[a:b]) for a, b in self.bounds)
        self.timeline: StageTimeline | None = None

    @property
    def is_first(self) -> bool:
        """Whether this rank holds the model's first layers (virtual stage 0: it takes the inputs)."""
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        """Whether this rank holds the model's last layers (virtual stage p*v - 1: it computes the loss)."""
        return self.rank == self.num_stages - 1

    def whole_name(self, name: str) -> str:
        """A local parameter or buffer name -> its name in the whole model: chunk c's
        ``chunks.c.i.x`` is ``layers.{start_c + i}.x`` (the model's ``layers`` list, as a
        :class:`~.pipeline.PipelineStage`'s ``layers.i.x`` is ``layers.{start + i}.x``)."""
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[0] != "chunks":
            raise ConfigError(f"InterleavedStage.whole_name: {name!r} is not a name of this stage's chunks")
        _, c, i, rest = parts
        return f"layers.{self.bounds[int(c)][0] + int(i)}.{rest}"

    @classmethod
    def from_topology(cls, model_or_layers, topo, virtual_stages: int, **kwargs) -> "InterleavedStage":
        kwargs.setdefault("group", topo.pp_group)
        return cls(model_or_layers, topo.pp_rank, topo.pp, virtual_stages, topo.pp_ranks, **kwargs)

    def tag(self, boundary: int, k: int, m: int, channel: str) -> int:
        t = self.tag_base + 2 * (boundary * m + k) + (channel == "grad")
        if t >= tags.PIPELINE.stop:
            raise ConfigError(f"interleaved 1F1B: {self.num_stages * self.virtual_stages} virtual stages x {m} "
                              f"micro-batches need more tags than the pipeline range has; use fewer micro-batches")
        return t


def interleaved_step(stage: InterleavedStage, inputs=None, targets=None, loss_fn=None, *,
                     num_microbatches: int, hooks: MicrobatchHooks | None = None) -> torch.Tensor | None:
    """Forward and backward of m micro-batches with the interleaved schedule (module doc).
    Rank 0 passes the batch (B, ...), the last rank the targets and ``loss_fn``; gradients
    accumulate in ``.grad`` (each micro-batch loss scaled by 1/m); the last rank returns the
    mean micro-batch loss, the others None. ``hooks``: as :func:`~.pipeline.pipeline_step`'s (the loss
    unscaled, the generator's state passed on with each activation, a micro-batch's gradients complete on
    this rank after its chunk 0's backward)."""
    p, r, v, m = stage.num_stages, stage.rank, stage.virtual_stages, num_microbatches
    ops = interleaved_ops(p, r, v, m)
    first, last = r == 0, r == p - 1
    if first == (inputs is None) or last == (targets is None) or (last and loss_fn is None):
        raise ConfigError(f"interleaved_step: rank {r} of {p}: pass inputs on rank 0 only, targets and loss_fn "
                          f"on rank {p - 1} only")
    xs = split_microbatches(inputs, m) if first else None
    ys = split_microbatches(targets, m, what="batch of targets") if last else None
    prev, nxt = stage.ranks[(r - 1) % p], stage.ranks[(r + 1) % p]
    device = next((q.device for q in stage.parameters()), None)  # received tensors land beside the parameters
    tl = stage.timeline = StageTimeline(stage=r, rank=stage.ranks[r], num_stages=p,
                                        schedule=f"interleaved(v={v})", num_microbatches=m)
    saved: dict[tuple[int, int], tuple] = {}
    pending, losses, clock = [], [], time.perf_counter

    def recv(peer: int, tag: int, k: int, channel: str) -> torch.Tensor:
        t0 = clock()
        x = comm.recv_tensor(peer, stage.group, tag, device=device, label=LABEL)
        tl.add_wait("recv_" + channel, k, t0, clock())
        return x

    for kind, c, k in ops:
        j = c * p + r
        if kind == "F":
            if j == 0:
                x = xs[k]
                if hooks is not None:
                    hooks.forward(k)
            else:
                x = recv(prev, stage.tag(j - 1, k, m, "act"), k, "act")
                if not x.is_floating_point():
                    raise ConfigError(f"interleaved 1F1B: virtual stage {j} received a {x.dtype} activation; only "
                                      f"the first chunk may take non-floating inputs (cut after the embedding)")
                x.requires_grad_()  # a leaf: its .grad goes back to virtual stage j - 1
                if hooks is not None:
                    recv_rng(prev, stage.group, stage.tag(j - 1, k, m, "act"))
            t0 = clock()
            out = stage.chunks[c](x)
            if j == p * v - 1:
                loss = loss_fn(out, ys[k])
                losses.append(loss.detach())
                if hooks is None:
                    out = loss / m
                else:
                    hooks.loss(k, loss)
                    out = loss
            else:
                pending += comm.isend_tensor(out, nxt, stage.group, stage.tag(j, k, m, "act"), label=LABEL)
                if hooks is not None:
                    pending += send_rng(nxt, stage.group, stage.tag(j, k, m, "act"))
            tl.add("F", k, t0, clock())
            saved[(c, k)] = (x, out)
        else:
            grad = None
            if j < p * v - 1:
                grad = recv(nxt, stage.tag(j, k, m, "grad"), k, "grad")
            x, out = saved.pop((c, k))
            t0 = clock()
            if out.requires_grad:
                torch.autograd.backward(out, grad)
            tl.add("B", k, t0, clock())
            if j > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                pending += comm.isend_tensor(gx, prev, stage.group, stage.tag(j - 1, k, m, "grad"), label=LABEL)
            if hooks is not None:
                hooks.grads(k, c == 0)
        tl.note_held(len(saved), 0)
        pending = [(w, t) for w, t in pending if not w.is_completed()]
    for w, _ in pending:
        w.wait()
    return torch.stack(losses).mean() if last else None
