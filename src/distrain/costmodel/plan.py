"""``distrain plan``: rank training strategies for a model on a cluster by predicted step time.

Step-time model (per optimizer step on a global batch of B samples; T = forward+backward
time of the whole batch on one process, measured once here or given with --compute-ms;
backward = 2/3 of it, the usual 2:1 FLOP ratio):

* DDP with dp = P ranks (ring/tree/star): compute T/P, plus the gradient all-reduce of
  4·N_params bytes (simulated schedule). Buckets overlap with backward (Li et al., PyTorch
  Distributed, VLDB 2020): only the part of the all-reduce that outlasts backward, plus the
  last of k = ceil(grad/25 MiB) buckets, is exposed.
* Parameter server, S shards on the last S ranks, W = P - S workers: compute T/W, plus
  one pull + push round (simulated), not overlapped (pull before forward, push after).
* dp×tp×pp (Megatron layout, tp innermost and inside one node): compute T/(dp·tp·pp)
  stretched by the pipeline bubble to (m+p-1)/m (Huang et al., GPipe 2019); TP adds 4
  all-reduces per block of b·s·h·4 bytes per micro-batch (Shoeybi et al., Megatron-LM 2019,
  f/g operators: 2 forward, 2 backward); DP all-reduces the stage's 4·N/(tp·pp) bytes, all
  dp groups at once so they share node links.
* Memory per rank (fp32, AdamW): 16 bytes per parameter held (weights, gradients, two
  moments), plus activations: per layer and sample s·h·(34 + 5·a·s/h)·2 bytes
  (Korthikanti et al. 2022, fp16 counted twice for fp32), divided by tp, for the 1F1B
  in-flight micro-batches min(p, m) on the first stage.

Concurrent collectives of independent groups are simulated together (links are shared).
The numbers are predictions from the α-β links (presets or a calibration), not measurements.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass

from distrain.costmodel import schedules
from distrain.costmodel.links import INTRA, LINKS, Fabric, block_placement, calibrated_fabric
from distrain.costmodel.sim import Message, simulate
from distrain.errors import ConfigError

BUCKET = 25 << 20


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: int
    layers: int = 0  # transformer blocks (0: not a transformer: no TP/PP)
    hidden: int = 0
    heads: int = 0
    seq: int = 1


@dataclass
class Plan:
    strategy: str
    step_s: float
    compute_s: float
    comm_s: float
    mem_bytes: float
    busiest_bytes: float


def model_spec(name: str | None, params: int | None) -> ModelSpec:
    if params:
        return ModelSpec(f"{params:,} params", int(params))
    from distrain.models import build_model
    from distrain.models.registry import MODEL_PRESETS

    if name not in MODEL_PRESETS:
        raise ConfigError(f"--model: unknown model {name!r}; choose from {', '.join(MODEL_PRESETS)} or give --params N")
    m = build_model(name)
    n = sum(p.numel() for p in m.parameters())
    kind, kw = MODEL_PRESETS[name]
    if kind == "gpt":
        return ModelSpec(name, n, kw["n_layer"], kw["n_embd"], kw["n_head"], kw["block_size"])
    return ModelSpec(name, n)


def measure_compute(name: str, batch: int, reps: int = 3) -> float:
    """Median forward+backward seconds of the preset on a batch of ``batch`` on this process."""
    import torch

    from distrain.models import build_model
    from distrain.models.registry import MODEL_PRESETS

    torch.manual_seed(0)
    m = build_model(name)
    kind, kw = MODEL_PRESETS[name]
    x = (torch.randint(0, kw["vocab_size"], (batch, kw["block_size"])) if kind == "gpt"
         else torch.randn(batch, kw["in_features"]))
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        m(x).float().sum().backward()
        ts.append(time.perf_counter() - t0)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def _together(parts: list[tuple[list[Message], float]], groups: list[list[int]]) -> tuple[list[Message], float]:
    """Several groups' schedules at once: group ranks -> global ranks, dependency ids shifted."""
    out: list[Message] = []
    tail = 0.0
    for (msgs, t), g in zip(parts, groups):
        base = len(out)
        out += [Message(g[m.src], g[m.dst], m.nbytes, tuple(d + base for d in m.deps), m.delay) for m in msgs]
        tail = max(tail, t)
    return out, tail


def _allreduce(fabric: Fabric, groups: list[list[int]], nbytes: int, alg: str) -> tuple[float, float]:
    """(seconds, bytes on the busiest link) of one all-reduce in every group at once."""
    if len(groups[0]) == 1 or nbytes <= 0:
        return 0.0, 0.0
    P = len(groups[0])
    parts = [schedules.BUILDERS[alg]("all_reduce", P, max(1, nbytes // 4), 4, fabric.gamma) for _ in groups]
    msgs, tail = _together(parts, groups)
    res = simulate(msgs, fabric, tail)
    return res.seconds, res.busiest()[1]


def _act_bytes(m: ModelSpec, samples: float) -> float:
    if not m.hidden:  # not a transformer preset: activations not modelled
        return 0.0
    return m.seq * m.hidden * (34 + 5 * m.heads * m.seq / m.hidden) * 2 * samples


def plan_ddp(m: ModelSpec, fabric: Fabric, T: float, batch: int, alg: str) -> Plan:
    P = fabric.size
    comm, busy = _allreduce(fabric, [list(range(P))], 4 * m.params, alg)
    bwd = T / P * 2 / 3
    k = max(1, math.ceil(4 * m.params / BUCKET))
    exposed = max(comm / k, comm - bwd * (k - 1) / k)
    mem = 16 * m.params + m.layers * _act_bytes(m, batch / P)
    return Plan(f"ddp {alg}", T / P + exposed, T / P, comm, mem, busy)


def plan_ps(m: ModelSpec, fabric: Fabric, T: float, batch: int, S: int) -> Plan:
    P = fabric.size
    W = P - S
    msgs, tail = schedules.parameter_server(P, S, 4 * m.params, fabric.gamma)
    res = simulate(msgs, fabric, tail)
    mem = max(8 * m.params + m.layers * _act_bytes(m, batch / W), 16 * m.params / S)
    return Plan(f"ps-sync S={S}", T / W + res.seconds, T / W, res.seconds, mem, res.busiest()[1])


def plan_3d(m: ModelSpec, fabric: Fabric, T: float, batch: int, dp: int, tp: int, pp: int, micro: int,
            alg: str) -> Plan:
    P = dp * tp * pp
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731  (tp innermost, then pp, then dp)
    b = batch / dp / micro  # samples per micro-batch
    compute = T / P * (micro + pp - 1) / micro
    tp_s = 0.0
    if tp > 1:
        groups = [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)]
        one, _ = _allreduce(fabric, groups, int(b * m.seq * m.hidden * 4), "ring")
        tp_s = one * 4 * (m.layers // pp) * (micro + pp - 1)  # per block, per micro-batch slot
    pp_s = 0.0
    if pp > 1:  # activations forward and gradients backward across each stage boundary
        s, r = rank(0, 0, 0), rank(0, 1, 0)
        hop = fabric.alpha(s, r) + b * m.seq * m.hidden * 4 / min(fabric.bandwidth(x) for x in fabric.path(s, r))
        pp_s = 2 * hop * (micro + pp - 1)
    dp_groups = [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]
    dp_s, busy = _allreduce(fabric, dp_groups, 4 * m.params // (tp * pp), alg)
    held = m.params / (tp * pp)
    mem = 16 * held + (m.layers / pp) * _act_bytes(m, b) / tp * min(pp, micro)
    return Plan(f"dp{dp} x tp{tp} x pp{pp} ({alg})", compute + tp_s + pp_s + dp_s, compute, tp_s + pp_s + dp_s,
                mem, busy)


def plans(m: ModelSpec, fabric: Fabric, T: float, batch: int, procs_per_node: int, micro: int) -> list[Plan]:
    P = fabric.size
    out = [plan_ddp(m, fabric, T, batch, a) for a in ("ring", "tree", "star")]
    out += [plan_ps(m, fabric, T, batch, S) for S in sorted({1, 2, 4}) if S < P]
    if m.layers:
        for tp in (t for t in (2, 4, 8) if procs_per_node % t == 0 and m.heads % t == 0 and P % t == 0):
            for pp in (p for p in (1, 2, 4, 8) if m.layers % p == 0 and P % (tp * p) == 0):
                out.append(plan_3d(m, fabric, T, batch, P // (tp * pp), tp, pp, micro, "ring"))
        for pp in (p for p in (2, 4, 8) if m.layers % p == 0 and P % p == 0):
            out.append(plan_3d(m, fabric, T, batch, P // pp, 1, pp, micro, "ring"))
    return sorted(out, key=lambda p: p.step_s)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Predicted step time, memory and busiest-link bytes of every strategy; see docs/cost_model.md."
    p.add_argument("--model", default="gpt-small", help="a model preset (default gpt-small)")
    p.add_argument("--params", type=int, default=None, help="plan for N parameters instead (DDP/PS only)")
    p.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    p.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--link", default="eth-1g", help=f"between nodes: {', '.join(LINKS)} (default eth-1g)")
    p.add_argument("--intra", default="shm", help=f"within a node: {', '.join(INTRA)} (default shm)")
    p.add_argument("--calibration", default=None, help="use a `distrain bench link --json` file for the links instead")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches (default 8)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="forward+backward of the global batch on one process; default: measured here (presets)")


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or args.procs_per_node < 1 or args.batch_size < 1 or args.microbatches < 1:
        raise ConfigError("--nodes, --procs-per-node, --batch-size and --microbatches must be >= 1")
    m = model_spec(None if args.params else args.model, args.params)
    P = args.nodes * args.procs_per_node
    if P < 2:
        raise ConfigError("plan: give at least 2 ranks (--nodes x --procs-per-node)")
    placement = block_placement(P, args.procs_per_node)
    if args.calibration:
        fabric = calibrated_fabric(args.calibration, placement)
    else:
        if args.link not in LINKS or args.intra not in INTRA:
            raise ConfigError(f"--link must be one of {', '.join(LINKS)} and --intra one of {', '.join(INTRA)}")
        fabric = Fabric(placement, LINKS[args.link], INTRA[args.intra])
    if args.compute_ms is not None:
        T = args.compute_ms / 1e3
    elif args.params:
        raise ConfigError("--params needs --compute-ms (forward+backward time of the global batch on one process)")
    else:
        T = measure_compute(args.model, args.batch_size)
    rows = plans(m, fabric, T, args.batch_size, args.procs_per_node, args.microbatches)
    print(f"# {m.name}: {m.params:,} parameters, batch {args.batch_size}, compute {T * 1e3:.1f} ms/step on one "
          f"process; {args.nodes} node(s) x {args.procs_per_node} = {P} ranks; link "
          f"{args.calibration or args.link} (intra {args.intra})")
    print(f"{'rank':>4}  {'strategy':<28} {'step ms':>9} {'compute':>9} {'comm':>9} {'mem/rank MB':>11} {'busiest link MB':>15}")
    for i, r in enumerate(rows, 1):
        print(f"{i:>4}  {r.strategy:<28} {r.step_s * 1e3:>9.2f} {r.compute_s * 1e3:>9.2f} {r.comm_s * 1e3:>9.2f} "
              f"{r.mem_bytes / 1e6:>11.1f} {r.busiest_bytes / 1e6:>15.2f}")
    return 0
