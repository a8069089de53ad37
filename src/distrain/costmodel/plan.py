"""``distrain plan``: rank training strategies for a model on a cluster by predicted step time.

Step-time model (per optimizer step on a global batch of B samples). Compute is
:class:`Compute`: forward+backward of a rank's local batch b, fb(b), measured here at
that very batch for a preset (small batches do not scale linearly) or T·b/B from
--compute-ms; backward = 2/3 of it, the usual 2:1 FLOP ratio; and the optimizer step,
``opt`` seconds per parameter updated (measured: AdamW on the preset), 0 with --compute-ms.

* DDP with dp = P ranks (ring/tree/star): fb(B/P) + the optimizer step over every
  parameter, plus the exposed part of the gradient all-reduce. The gradients go in the
  buckets distrain's DDP builds (reverse parameter order, the first at most 1 MiB, then
  25 MiB: parallel/data_parallel/buckets.py); bucket i is ready when backward has produced its
  gradients (backward time taken proportional to the parameter bytes behind it) and its
  all-reduce (simulated schedule) starts once it is ready and the previous bucket's is done
  (one communication thread runs them in order). Exposed = the last all-reduce's end minus
  backward's end (Li et al., PyTorch Distributed, VLDB 2020).
* Parameter server, S shards on the last S ranks, W = P - S workers: fb(B/W), plus one pull
  + push round (simulated), not overlapped (pull before forward, push after), whose tail
  is the server's W adds and its optimizer step over N/S parameters.
* dp×tp×pp (Megatron layout, tp innermost and inside one node): compute T/(dp·tp·pp)
  stretched by the pipeline bubble to (m+p-1)/m (Huang et al., GPipe 2019); TP adds 4
  all-reduces per block of b·s·h·4 bytes per micro-batch (Shoeybi et al., Megatron-LM 2019,
  f/g operators: 2 forward, 2 backward); DP all-reduces the stage's 4·N/(tp·pp) bytes, all
  dp groups at once so they share node links.
* Memory per rank (fp32, AdamW): 16 bytes per parameter held (weights, gradients, two
  moments), plus activations: per layer and sample s·h·(34 + 5·a·s/h)·2 bytes
  (Korthikanti et al. 2022, fp16 counted twice for fp32), divided by tp, for the 1F1B
  in-flight micro-batches min(p, m) on the first stage.

Concurrent collectives of independent groups are predicted together (links are shared): rings in
closed form (:func:`~distrain.costmodel.collectives.ring_time`), star and tree by the simulator.
The numbers are predictions from the α-β links (presets or a calibration), not measurements.
The command line (distrain/cli/plan.py) checks the flags, builds the fabric and the compute,
and prints :func:`plans` with :func:`format_plans`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Callable

from distrain.costmodel import schedules
from distrain.costmodel.collectives import ring_time
from distrain.costmodel.links import INTRA, LINKS, Fabric, block_placement, calibrated_fabric  # noqa: F401 (API)
from distrain.costmodel.sim import Message, simulate
from distrain.costmodel.table import Row, format_table
from distrain.errors import ConfigError

BUCKET, FIRST_BUCKET = 25 << 20, 1 << 20  # as distrain's DDP (and torch's): bucket_cap_mb 25, first 1 MiB


@dataclass(frozen=True)
class ModelSpec:
    name: str
    params: int
    layers: int = 0  # transformer blocks (0: not a transformer: no TP/PP)
    hidden: int = 0
    heads: int = 0
    seq: int = 1
    param_bytes: tuple[int, ...] = ()  # every parameter tensor's bytes, model order (presets)


@dataclass(frozen=True)
class Compute:
    """Seconds of forward+backward for a local batch (``fb(samples)``) and of the optimizer per parameter."""
    fb: Callable[[float], float]
    opt: float = 0.0

    @classmethod
    def linear(cls, T: float, batch: int) -> "Compute":
        """--compute-ms: T for the global batch, proportional to the batch, no optimizer cost."""
        return cls(lambda b: T * b / batch)


@dataclass
class Plan:
    strategy: str
    step_s: float
    compute_s: float
    comm_s: float
    mem_bytes: float
    busiest_bytes: float
    tokens_per_s: float | None = None  # per rank (transformer presets; :func:`plans` sets it)


def model_spec(name: str | None, params: int | None) -> ModelSpec:
    if params:
        return ModelSpec(f"{params:,} params", int(params))
    from distrain.models import build_model
    from distrain.models.registry import MODEL_PRESETS

    if name not in MODEL_PRESETS:
        raise ConfigError(f"--model: unknown model {name!r}; choose from {', '.join(MODEL_PRESETS)} or give --params N")
    kind, kw = MODEL_PRESETS[name]
    if kind in ("gpt", "llama"):  # the tensor sizes from the shape: no model built (the 8B preset's build took 2 s)
        from distrain.costmodel.shapes import preset_shape

        sizes = tuple(4 * n for n in preset_shape(name).tensor_sizes())
        return ModelSpec(name, sum(sizes) // 4, kw["n_layer"], kw["n_embd"], kw["n_head"], kw["block_size"], sizes)
    from distrain.models.meta import shapes_only

    with shapes_only():  # no memory, so an 8B preset costs nothing to count
        m = build_model(name)
    n = sum(p.numel() for p in m.parameters())
    sizes = tuple(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad)
    return ModelSpec(name, n, param_bytes=sizes)


def measure_compute(name: str, batch: int, reps: int = 3) -> float:
    """Median forward+backward seconds of the preset on a batch of ``batch`` on this process."""
    import torch

    from distrain.models import build_model
    from distrain.models.registry import MODEL_PRESETS

    torch.manual_seed(0)
    m = build_model(name)
    kind, kw = MODEL_PRESETS[name]
    batch = max(1, round(batch))
    x = (torch.randint(0, kw["vocab_size"], (batch, kw["block_size"])) if kind in ("gpt", "llama")
         else torch.randn(batch, kw["in_features"]))
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        m(x).float().sum().backward()
        ts.append(time.perf_counter() - t0)
    return sorted(ts[1:])[len(ts[1:]) // 2]


def measure_optimizer(name: str, reps: int = 5) -> float:
    """Median seconds per parameter of one AdamW step (the trainer's default optimizer) on the preset."""
    import torch

    from distrain.models import build_model

    m = build_model(name)
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(params, lr=1e-3)
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        opt.step()
        ts.append(time.perf_counter() - t0)
    return sorted(ts[1:])[len(ts[1:]) // 2] / sum(p.numel() for p in params)


def measured_compute(name: str) -> Compute:
    """fb measured per local batch size (cached) and AdamW's step, on this process."""
    from distrain.models.registry import SHAPE_ONLY_PRESETS

    if name in SHAPE_ONLY_PRESETS:
        raise ConfigError(f"--model {name} has its published sizes only (no weights are built here, and one step "
                          f"would not fit this process): give --compute-ms, the forward+backward time of the "
                          f"global batch on one device")
    return Compute(functools.lru_cache(maxsize=None)(lambda b: measure_compute(name, b)), measure_optimizer(name))


def ddp_buckets(m: ModelSpec) -> list[int]:
    """Bucket bytes in launch order, as distrain's DDP packs them: parameters in reverse model
    order, the first bucket at most 1 MiB, the others 25 MiB, a parameter never split. With
    --params (no tensor sizes) the parameters are taken as 1 MiB tensors."""
    sizes = list(reversed(m.param_bytes)) if m.param_bytes else \
        [min(FIRST_BUCKET, 4 * m.params - i) for i in range(0, 4 * m.params, FIRST_BUCKET)]
    out: list[int] = []
    cur = 0
    for b in sizes:
        cap = FIRST_BUCKET if not out else BUCKET
        if cur and cur + b > cap:
            out.append(cur)
            cur = 0
        cur += b
    return out + [cur]


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
    """(seconds, bytes on the busiest link) of one all-reduce in every group at once: the ring in
    closed form (:func:`~distrain.costmodel.collectives.ring_time`: equal chunks, links shared by
    counting their messages), star and tree replayed by the simulator (one message per rank and
    phase); each (fabric, groups, size, algorithm) once."""
    if len(groups[0]) == 1 or nbytes <= 0:
        return 0.0, 0.0
    key = tuple(tuple(g) for g in groups)
    if alg == "ring":
        return _ring(fabric, key, max(4, nbytes // 4 * 4))
    return _simulated(fabric, key, nbytes, alg)


@functools.lru_cache(maxsize=1024)
def _ring(fabric: Fabric, groups: tuple, nbytes: int) -> tuple[float, float]:
    return ring_time(fabric, groups, nbytes)


@functools.lru_cache(maxsize=1024)
def _simulated(fabric: Fabric, groups: tuple, nbytes: int, alg: str) -> tuple[float, float]:
    P = len(groups[0])
    parts = [schedules.BUILDERS[alg]("all_reduce", P, max(1, nbytes // 4), 4, fabric.gamma) for _ in groups]
    msgs, tail = _together(parts, [list(g) for g in groups])
    res = simulate(msgs, fabric, tail)
    return res.seconds, res.busiest()[1]


def simulated_allreduce(fabric: Fabric, groups: list[list[int]], nbytes: int, alg: str) -> tuple[float, float]:
    """The fine path for every algorithm (the ring's 1 MiB pieces replayed too): what the closed form is checked
    against (docs/cost_model.md, "Speed")."""
    return _simulated(fabric, tuple(tuple(g) for g in groups), nbytes, alg)


def _act_bytes(m: ModelSpec, samples: float) -> float:
    if not m.hidden:  # not a transformer preset: activations not modelled
        return 0.0
    return m.seq * m.hidden * (34 + 5 * m.heads * m.seq / m.hidden) * 2 * samples


def plan_ddp(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, alg: str) -> Plan:
    P = fabric.size
    fb = c.fb(batch / P)
    total = 4 * m.params
    comm = busy = end = done = 0.0
    for b in ddp_buckets(m):  # one communication thread: all-reduces in launch order
        done += b
        ready = fb / 3 + fb * 2 / 3 * done / total  # backward has produced this bucket's gradients
        t, link = _allreduce(fabric, [list(range(P))], b, alg)
        end = max(ready, end) + t
        comm, busy = comm + t, busy + link
    compute = fb + c.opt * m.params
    mem = 16 * m.params + m.layers * _act_bytes(m, batch / P)
    return Plan(f"ddp {alg}", compute + max(0.0, end - fb), compute, comm, mem, busy)


def plan_ps(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, S: int) -> Plan:
    P = fabric.size
    W = P - S
    msgs, tail = schedules.parameter_server(P, S, 4 * m.params, fabric.gamma, update_s=c.opt * m.params / S or None)
    res = simulate(msgs, fabric, tail)
    mem = max(8 * m.params + m.layers * _act_bytes(m, batch / W), 16 * m.params / S)
    fb = c.fb(batch / W)
    return Plan(f"ps-sync S={S}", fb + res.seconds, fb, res.seconds, mem, res.busiest()[1])


def plan_3d(m: ModelSpec, fabric: Fabric, c: Compute, batch: int, dp: int, tp: int, pp: int, micro: int,
            alg: str) -> Plan:
    rank = lambda d, p, t: (d * pp + p) * tp + t  # noqa: E731  (tp innermost, then pp, then dp)
    b = batch / dp / micro  # samples per micro-batch
    # a stage of a tp group does 1/(tp·pp) of a replica's work, stretched by the bubble
    compute = c.fb(batch / dp) / (tp * pp) * (micro + pp - 1) / micro + c.opt * m.params / (tp * pp)
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


def plans(m: ModelSpec, fabric: Fabric, T: float | Compute, batch: int, procs_per_node: int,
          micro: int) -> list[Plan]:
    """Every strategy, best first; ``T``: forward+backward seconds of the global batch (linear) or a Compute."""
    P = fabric.size
    c = T if isinstance(T, Compute) else Compute.linear(T, batch)
    out = [plan_ddp(m, fabric, c, batch, a) for a in ("ring", "tree", "star")]
    out += [plan_ps(m, fabric, c, batch, S) for S in sorted({1, 2, 4}) if S < P]
    if m.layers:
        for tp in (t for t in (2, 4, 8) if procs_per_node % t == 0 and m.heads % t == 0 and P % t == 0):
            for pp in (p for p in (1, 2, 4, 8) if m.layers % p == 0 and P % (tp * p) == 0):
                out.append(plan_3d(m, fabric, c, batch, P // (tp * pp), tp, pp, micro, "ring"))
        for pp in (p for p in (2, 4, 8) if m.layers % p == 0 and P % p == 0):
            out.append(plan_3d(m, fabric, c, batch, P // pp, 1, pp, micro, "ring"))
        for p in out:
            p.tokens_per_s = batch * m.seq / p.step_s / P
    return sorted(out, key=lambda p: p.step_s)


def format_plans(rows: list[Plan], memory: float | None = None) -> str:
    """The ranking of :func:`plans` as the text table ``distrain plan`` prints (rank 1 first; the columns of
    :mod:`distrain.costmodel.table`). With ``memory`` (bytes per rank), only the layouts that fit it are ranked;
    a line counts them, and the others follow it unranked, smallest first."""
    fits = [r for r in rows if memory is None or r.mem_bytes <= memory]
    over = sorted((r for r in rows if memory is not None and r.mem_bytes > memory), key=lambda r: r.mem_bytes)
    between = None if memory is None else \
        f"# {len(fits)} layouts fit, {len(over)} do not fit {memory / 1e9:.3g} GB per rank" + (":" if over else "")
    return format_table([_row(r) for r in fits], [_row(r) for r in over], between)


def _row(p: Plan) -> Row:
    return Row(p.strategy, p.step_s, p.compute_s, p.comm_s, p.tokens_per_s, None, None, p.mem_bytes, p.busiest_bytes)
