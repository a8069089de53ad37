"""The pure part of pipeline parallelism: partitioning, micro-batches, schedules, simulation.

Nothing here starts a process or touches ``torch.distributed``; :mod:`distrain.parallel.pipeline_parallel.pipeline`
runs what is planned here. Everything is deterministic and testable in one process.

* :func:`partition` cuts a layer list into contiguous stages (balanced by parameter count,
  or by explicit layer counts);
* :func:`split_microbatches` cuts a batch into ``m`` equal micro-batches;
* :func:`schedule_ops` lists one stage's compute ops, ``[("F", 0), ("F", 1), ("B", 0), ...]``,
  for GPipe, 1F1B or zero-bubble ZB-H1 (which adds ("W", k), :mod:`.zero_bubble`);
* :func:`simulate` plays every stage's program (receive, compute, send) with given op costs
  and either non-blocking sends (what the executor does) or blocking rendezvous sends (what a
  plain ``send`` does on Gloo), returning the ideal timeline or raising
  :class:`ScheduleDeadlock` naming what each stage is blocked on.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from distrain.errors import ConfigError, DistrainError
from distrain.parallel.pipeline_parallel.timeline import PipelineTimeline, StageTimeline
from distrain.parallel.pipeline_parallel.zero_bubble import zb_h1_bubble, zb_h1_ops

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
SPLIT_BACKWARD = ("zb-h1",)  # schedules whose backward is B (input gradient) + W (weight gradient)


class ScheduleDeadlock(DistrainError):
    """:func:`simulate` found that no stage can make progress."""


# ---------------------------------------------------------------------------------------
# Partitioning
# ---------------------------------------------------------------------------------------

def _layer_list(layers) -> list[nn.Module]:
    if isinstance(layers, nn.Module) and hasattr(layers, "layers"):
        layers = layers.layers  # a model laid out like GPT / MLP
    if isinstance(layers, nn.Module) and not isinstance(layers, (nn.ModuleList, nn.Sequential)):
        raise ConfigError(f"partition: expected a model with a `.layers` list or a sequence of modules, "
                          f"got {type(layers).__name__}")
    out = list(layers)
    for i, layer in enumerate(out):
        if not isinstance(layer, nn.Module):
            raise ConfigError(f"partition: layer {i} is a {type(layer).__name__}, not an nn.Module")
    return out


def layer_costs(layers) -> list[int]:
    """Parameter count of each layer (unique parameters, each counted once, in the first layer holding it)."""
    seen: set[int] = set()
    costs = []
    for layer in _layer_list(layers):
        c = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                c += p.numel()
        costs.append(c)
    return costs


def _min_parts(costs: Sequence[int], cap: int) -> int:
    """Fewest contiguous parts with sums <= cap (greedy packing is optimal); inf if a layer exceeds cap."""
    parts, run = 0, None
    for c in costs:
        if c > cap:
            return 1 << 60
        if run is None or run + c > cap:
            parts, run = parts + 1, c
        else:
            run += c
    return parts


def _balanced_counts(costs: list[int], k: int) -> list[int]:
    """Layer counts per stage minimizing the largest stage cost.

    Exact: the optimal bottleneck M is one of the contiguous range sums; a cap is feasible
    for exactly k non-empty parts iff greedy packing needs <= k parts (parts can always be
    split further while there are at least k layers). Ties are broken deterministically by
    giving each stage, from the first, the fewest layers that keep the rest feasible.
    """
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    candidates = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # binary search the smallest feasible cap
    while lo < hi:
        mid = (lo + hi) // 2
        if _min_parts(costs, candidates[mid]) <= k:
            hi = mid
        else:
            lo = mid + 1
    cap = candidates[lo]
    counts, start = [], 0
    for stage in range(k):
        left = k - stage - 1  # stages after this one
        if left == 0:
            counts.append(n - start)
            break
        for c in range(1, n - start - left + 1):
            if prefix[start + c] - prefix[start] > cap:
                raise AssertionError("unreachable: the cap was feasible")  # pragma: no cover
            rest = costs[start + c:]
            if _min_parts(rest, cap) <= left <= len(rest):
                counts.append(c)
                start += c
                break
    return counts


def partition(layers, num_stages: int, balance: str | Sequence[int] = "params", *,
              name: str = "the model") -> list[tuple[int, int]]:
    """Split ``layers`` into ``num_stages`` contiguous stages; returns half-open ``(start, stop)`` per stage.

    ``layers``: a model with a ``.layers`` list (GPT, MLP), an ``nn.ModuleList`` or a list of
    modules. ``balance="params"`` minimizes the largest stage's parameter count (exact, ties
    broken by giving earlier stages fewer layers); ``balance=[n0, n1, ...]`` gives the layer
    count of each stage explicitly. ``name`` is used in error messages.

    gpt-tiny's 6 layers cost [8704, 12704, 12704, 12704, 12704, 8256] parameters
    (Embedding, 4 Blocks, Head); by params: 2 stages -> [(0, 3), (3, 6)],
    3 -> [(0, 2), (2, 4), (4, 6)], 4 -> [(0, 2), (2, 3), (3, 4), (4, 6)].
    """
    items = _layer_list(layers)
    n = len(items)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ConfigError(f"partition: num_stages must be a positive int, got {num_stages!r}")
    if n < num_stages:
        raise ConfigError(f"{name} has {n} layers but {num_stages} stages were asked for; "
                          f"use at most {n} stages")
    if isinstance(balance, str):
        if balance != "params":
            raise ConfigError(f"partition: balance must be 'params' or a list of layer counts per stage, "
                              f"got {balance!r}")
        counts = _balanced_counts(layer_costs(items), num_stages)
    else:
        counts = list(balance)
        if len(counts) != num_stages:
            raise ConfigError(f"partition: balance {counts} has {len(counts)} entries but there are "
                              f"{num_stages} stages; give one layer count per stage")
        if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts):
            raise ConfigError(f"partition: balance {counts} must hold positive ints (every stage needs "
                              f"at least one layer)")
        if sum(counts) != n:
            raise ConfigError(f"partition: balance {counts} sums to {sum(counts)} but {name} has {n} layers; "
                              f"the counts must add up to {n}")
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


# ---------------------------------------------------------------------------------------
# Micro-batches
# ---------------------------------------------------------------------------------------

def split_microbatches(batch: torch.Tensor, num_microbatches: int, *, what: str = "batch") -> list[torch.Tensor]:
    """Split ``batch`` (B, ...) along dim 0 into ``num_microbatches`` views of (B/m, ...)."""
    m = num_microbatches
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"num_microbatches must be a positive int, got {m!r}")
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        raise ConfigError(f"{what} must be a tensor with a batch dimension, got {type(batch).__name__}")
    B = batch.shape[0]
    if B % m != 0:
        raise ConfigError(f"{what} {B} is not divisible into {m} micro-batches; "
                          f"use a number of micro-batches that divides {B}")
    return list(batch.split(B // m, dim=0))  # m views of (B/m, ...)


# ---------------------------------------------------------------------------------------
# Schedules
# ---------------------------------------------------------------------------------------

def check_schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(map(repr, SCHEDULES))}")
    return schedule


def warmup_forwards(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Forwards a stage runs before its first backward: m for GPipe, min(p - s - 1, m) for 1F1B,
    min(p - s, m) for ZB-H1 (1F1B's warm-up and its first steady-state forward)."""
    check_schedule(schedule)
    if schedule == "gpipe":
        return num_microbatches
    if schedule == "zb-h1":
        return min(num_stages - stage, num_microbatches)
    return min(num_stages - stage - 1, num_microbatches)


def schedule_ops(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple[str, int]]:
    """The compute ops of ``stage`` in execution order: ("F", k) forward, ("B", k) backward of micro-batch k
    (under ZB-H1 its input-gradient part, and ("W", k) its weight-gradient part: :func:`zb_h1_ops`).

    GPipe: F0 .. F(m-1), then B(m-1) .. B0 (reverse order, as in the GPipe paper's figure).
    1F1B (PipeDream-Flush): w = min(p - s - 1, m) warm-up forwards, then m - w pairs
    (F(w + i), B(i)), then the w remaining backwards; at most w + 1 = min(p - s, m)
    micro-batches are in flight at once.
    """
    p, s, m = num_stages, stage, num_microbatches
    if not 0 <= s < p:
        raise ConfigError(f"stage {s} is out of range [0, {p})")
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
        raise ConfigError(f"num_microbatches must be a positive int, got {m!r}")
    if check_schedule(schedule) == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in reversed(range(m))]
    if schedule == "zb-h1":
        return zb_h1_ops(p, s, m)
    w = warmup_forwards(schedule, p, s, m)
    ops = [("F", k) for k in range(w)]
    for i in range(m - w):
        ops += [("F", w + i), ("B", i)]
    ops += [("B", k) for k in range(m - w, m)]
    return ops


def peak_in_flight(ops: Sequence[tuple[str, int]]) -> int:
    """Most micro-batches forwarded but not yet backwarded at once, in an op list (with W ops:
    not yet through their W, which still needs the layers' inputs)."""
    done = "W" if any(kind == "W" for kind, _ in ops) else "B"
    held = peak = 0
    for kind, _ in ops:
        held += 1 if kind == "F" else -1 if kind == done else 0
        peak = max(peak, held)
    return peak


def stage_program(schedule: str, num_stages: int, stage: int, num_microbatches: int) -> list[tuple]:
    """The primitive actions of one stage, exactly as the executor performs them.

    ("recv", peer, channel, k), ("compute", kind, k), ("send", peer, channel, k); channel "act"
    carries a forward activation to stage s+1, "grad" a gradient back to stage s-1; a W op
    ("compute", "W", k) neither receives nor sends.
    """
    p, s = num_stages, stage
    prog: list[tuple] = []
    for kind, k in schedule_ops(schedule, p, s, num_microbatches):
        if kind == "W":
            prog.append(("compute", "W", k))
        elif kind == "F":
            if s > 0:
                prog.append(("recv", s - 1, "act", k))
            prog.append(("compute", "F", k))
            if s < p - 1:
                prog.append(("send", s + 1, "act", k))
        else:
            if s < p - 1:
                prog.append(("recv", s + 1, "grad", k))
            prog.append(("compute", "B", k))
            if s > 0:
                prog.append(("send", s - 1, "grad", k))
    return prog


def simulate(schedule: str, num_stages: int, num_microbatches: int, *, f_cost: float = 1.0,
             b_cost: float = 2.0, comm_cost: float = 0.0, blocking_sends: bool = False,
             w_cost: float | None = None):
    """Play every stage's program with fixed op costs; return the ideal :class:`PipelineTimeline`.

    ``b_cost`` is a whole backward; a schedule that splits it (ZB-H1) runs W for ``w_cost``
    (default ``b_cost / 2``) and B for the rest, so every schedule does the same work.

    Receives block until the matching message has been sent (and ``comm_cost`` has passed).
    With ``blocking_sends=False`` (the executor's way: ``isend`` posted, waited on only
    later) a send never blocks. With ``blocking_sends=True`` a send completes only when the
    receiver has posted the matching receive (rendezvous: what Gloo's blocking ``send``
    does, even for one element). Raises :class:`ScheduleDeadlock` when no stage can move.

    Because a stage's only blocking operation is a receive from a fixed peer on a fixed
    channel, the stages form a Kahn process network: whether it deadlocks does not depend on
    timing, so a completed simulation proves the real run cannot deadlock either.
    """
    p, m = num_stages, num_microbatches
    progs = [stage_program(schedule, p, s, m) for s in range(p)]
    pc = [0] * p
    clock = [0.0] * p
    sent: dict[tuple, float] = {}  # (src, dst, channel, k) -> time the message is available
    tls = [StageTimeline(stage=s, rank=s, num_stages=p, schedule=schedule, num_microbatches=m) for s in range(p)]
    held = [0] * p
    split = schedule in SPLIT_BACKWARD
    w_cost = (b_cost / 2 if w_cost is None else w_cost) if split else 0.0
    cost = {"F": f_cost, "B": b_cost - w_cost, "W": w_cost}
    freed_by = "W" if split else "B"  # the op after which a micro-batch's activations are dropped

    def matching_recv_posted(s, action) -> bool:
        _, dst, ch, k = action
        return pc[dst] < len(progs[dst]) and progs[dst][pc[dst]] == ("recv", s, ch, k)

    progress = True
    while progress:
        progress = False
        for s in range(p):
            while pc[s] < len(progs[s]):
                a = progs[s][pc[s]]
                if a[0] == "compute":
                    tls[s].add(a[1], a[2], clock[s], clock[s] + cost[a[1]])
                    clock[s] += cost[a[1]]
                    held[s] += 1 if a[1] == "F" else -1 if a[1] == freed_by else 0
                    tls[s].note_held(held[s], 0)
                elif a[0] == "recv":
                    key = (a[1], s, a[2], a[3])
                    if key not in sent:
                        break
                    start = clock[s]
                    clock[s] = max(clock[s], sent.pop(key))
                    if clock[s] > start:
                        tls[s].add_wait("recv_" + a[2], a[3], start, clock[s])
                elif blocking_sends:
                    if not matching_recv_posted(s, a):
                        break
                    dst = a[1]
                    t = max(clock[s], clock[dst])  # both sides are there: the transfer happens
                    clock[s] = t
                    sent[(s, dst, a[2], a[3])] = t + comm_cost
                else:
                    sent[(s, a[1], a[2], a[3])] = clock[s] + comm_cost
                pc[s] += 1
                progress = True
    if any(pc[s] < len(progs[s]) for s in range(p)):
        blocked = "; ".join(
            f"stage {s} blocked in {progs[s][pc[s]][0]} {progs[s][pc[s]][2]} of micro-batch {progs[s][pc[s]][3]} "
            f"{'from' if progs[s][pc[s]][0] == 'recv' else 'to'} stage {progs[s][pc[s]][1]}"
            for s in range(p) if pc[s] < len(progs[s]))
        raise ScheduleDeadlock(f"{schedule} with p={p}, m={m}, "
                               f"{'blocking' if blocking_sends else 'non-blocking'} sends deadlocks: {blocked}")
    return PipelineTimeline(tls)


def ideal_bubble(num_stages: int, num_microbatches: int, schedule: str = "1f1b") -> float:
    """(p - 1) / (m + p - 1): the idle share of GPipe and 1F1B with equal stages and free communication;
    for ``schedule="zb-h1"`` (T_F = T_B = T_W) :func:`~.zero_bubble.zb_h1_bubble`, (p - 1) / (3m + p - 1) for m >= p."""
    if check_schedule(schedule) == "zb-h1":
        return zb_h1_bubble(num_stages, num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
