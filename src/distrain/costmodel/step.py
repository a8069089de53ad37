"""Step time of one transformer training layout on a GPU (or CPU) cluster.

A :class:`Cluster` is ``nodes`` x ``per_node`` devices of one kind, a link between the devices
of a node (NVLink, PCIe, shared memory) and one network port per device between nodes (a
rail-optimised fabric: DGX A100/H100, Meta's Grand Teton). A :class:`Layout` places a model on
it: dp x tp x pp x cp devices (Megatron-LM's order: tp innermost, then cp, then dp, pipeline
stages outermost, so tensor-parallel groups sit inside a node), a ZeRO stage, the micro-batch,
the recomputation, interleaved pipeline chunks, and two software switches: whether
tensor-parallel collectives overlap the matmuls (Megatron-Core's ``--tp-comm-overlap``) and
whether data-parallel ones overlap the backward pass (DDP buckets, FSDP prefetch,
``--overlap-grad-reduce``).

One step of a global batch of B sequences of s tokens (:func:`predict`):

* m = B / (dp · b) micro-batches of b sequences go through each pipeline; a stage's time per
  micro-batch is its blocks' forward and backward (:mod:`distrain.costmodel.kernels`; the last
  stage adds the head and the loss) plus the exposed communication of its blocks: tensor
  parallelism's 4 all-reduces of b·s/cp·h bf16 values per block (2 forward, 2 backward, 2 more
  under full recomputation; Shoeybi et al. 2019; with sequence parallelism the same bytes as
  all-gathers and reduce-scatters), context parallelism's all-gather of K and V (backward: the
  reduce-scatter of their gradients), overlapped with the attention, and expert parallelism's
  all-to-all dispatch and combine, forward and backward;
* the pipeline takes (m + (pp - 1)/v) stage times (1F1B, interleaved with v chunks: Narayanan et
  al. 2021) plus the 2(pp - 1) activation transfers of its fill and drain;
* ZeRO 0 all-reduces the gradients (fp32), 1 and 2 reduce-scatter them and all-gather the
  updated bf16 weights, 3 (FSDP) all-gathers the weights before each forward and backward of
  every micro-batch and reduce-scatters the gradients after it; overlapped, only what exceeds
  the compute it hides behind is exposed (the last micro-batch's backward for gradients, the
  first one's forward for ZeRO 1/2's weight gathers, every micro-batch's for FSDP);
* then the optimizer over the parameters this device updates.

Collectives are NCCL rings (:func:`distrain.costmodel.collectives.nccl_ring`). MFU is Megatron's
model FLOPs (:meth:`~distrain.costmodel.shapes.Shape.model_flops_per_token`) per second over the
devices' bf16 peak.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

from distrain.costmodel.collectives import NET_EFF, nccl_ring
from distrain.costmodel.devices import Device
from distrain.costmodel.kernels import RECOMPUTE, block_time, head_time, optimizer_time
from distrain.costmodel.links import Link
from distrain.costmodel.memory import Memory, memory, stage_params
from distrain.costmodel.shapes import Shape
from distrain.errors import ConfigError


@dataclass(frozen=True)
class Cluster:
    device: Device
    nodes: int
    per_node: int
    inter: Link  # one port per device between nodes
    intra: Link  # between the devices of one node

    def __post_init__(self):
        if self.nodes < 1 or self.per_node < 1:
            raise ConfigError(f"cluster: --nodes and --gpus-per-node must be >= 1, got {self.nodes} and "
                              f"{self.per_node}")

    @property
    def size(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    micro_batch: int = 1
    recompute: str = "none"
    vpp: int = 1  # interleaved pipeline chunks per stage
    sp: bool = True  # sequence parallelism with tp
    tp_overlap: bool = False
    dp_overlap: bool = True
    attention: str = "fa2"  # the fused attention kernel: fa2 (PyTorch SDPA's flash), fa3 (FA3 / cuDNN, Hopper)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}" + (f"v{self.vpp}" if self.vpp > 1 else ""),
                 f"cp{self.cp}"] + ([f"ep{self.ep}"] if self.ep > 1 else [])
        rc = {"none": "", "selective": " rc-sel", "full": " rc-full"}[self.recompute]
        return f"{' x '.join(parts)} z{self.zero} mb{self.micro_batch}{rc}"


@dataclass
class Prediction:
    layout: Layout
    step_s: float
    tokens_per_s: float  # per device
    mfu: float
    memory: Memory
    fits: bool
    busiest_link: str
    busiest_bytes: float  # per device and step on its busiest link
    parts: dict = field(default_factory=dict)  # seconds by component

    @property
    def tflops(self) -> float:
        return self.parts.get("model_flops_per_device_s", 0.0) / 1e12


def check(shape: Shape, cluster: Cluster, layout: Layout, batch: int, seq: int) -> None:
    """A one-line ConfigError for a layout that cannot run this model on this cluster."""
    L = layout
    if L.devices != cluster.size:
        raise ConfigError(f"layout dp {L.dp} x tp {L.tp} x pp {L.pp} x cp {L.cp} = {L.devices} devices, but the "
                          f"cluster has {cluster.nodes} x {cluster.per_node} = {cluster.size}; make them equal")
    if min(L.dp, L.tp, L.pp, L.cp, L.ep, L.micro_batch, L.vpp) < 1 or L.zero not in (0, 1, 2, 3):
        raise ConfigError("layout: dp, tp, pp, cp, ep, micro-batch, vpp must be >= 1 and --zero one of 0, 1, 2, 3")
    if L.recompute not in RECOMPUTE:
        raise ConfigError(f"--recompute {L.recompute!r}: choose from {', '.join(RECOMPUTE)}")
    if cluster.per_node % L.tp and L.tp % cluster.per_node:
        raise ConfigError(f"--tp {L.tp} does not tile nodes of {cluster.per_node} devices; use a divisor of "
                          f"{cluster.per_node}")
    if shape.heads % L.tp or shape.kv_heads % L.tp:
        raise ConfigError(f"--tp {L.tp}: {shape.name} has {shape.heads} query and {shape.kv_heads} key/value heads; "
                          f"choose a tp that divides both")
    if shape.layers < L.pp * L.vpp:
        raise ConfigError(f"--pp {L.pp} x --vpp {L.vpp}: {shape.name} has only {shape.layers} layers")
    if seq % (2 * L.cp) and L.cp > 1:
        raise ConfigError(f"--cp {L.cp}: the sequence of {seq} tokens does not cut into 2 x {L.cp} equal chunks")
    if L.ep > 1 and (not shape.moe or shape.experts % L.ep or (L.dp * L.cp * L.tp) % L.ep):
        raise ConfigError(f"--ep {L.ep}: needs a mixture of experts whose expert count and dp x cp x tp it divides")
    if batch % (L.dp * L.micro_batch):
        raise ConfigError(f"--batch-size {batch} does not split into dp {L.dp} x micro-batch {L.micro_batch}; "
                          f"give a multiple of {L.dp * L.micro_batch}")
    if L.zero == 3 and L.pp > 1:
        raise ConfigError("--zero 3 (FSDP) gathers weights per micro-batch; combine it with --pp 1")


def _per_node(group: int, inner: int, per_node: int) -> int:
    """Members of a group with ``inner`` devices between consecutive members that share a node."""
    return max(1, min(group, per_node // inner)) if inner < per_node else 1


@functools.lru_cache(maxsize=4096)
def _blocks(shape: Shape, dev: Device, b: int, s: int, tp: int, cp: int, ep: int, sp: bool, attention: str):
    return block_time(shape, dev, b, s, tp, cp, ep, sp, attention), head_time(shape, dev, b, s, tp, cp)


def predict(shape: Shape, cluster: Cluster, layout: Layout, batch: int, seq: int) -> Prediction:
    """Step time, throughput, MFU, memory and traffic of ``layout`` (call :func:`check` first)."""
    L, dev, G = layout, cluster.device, cluster.per_node
    b, tp, pp, cp, v = L.micro_batch, L.tp, L.pp, L.cp, L.vpp
    m = batch // (L.dp * b)
    T = b * seq / cp  # tokens of a micro-batch on one device
    act = 2.0 * T * shape.hidden  # bytes of one block's output for the micro-batch
    blk, head = _blocks(shape, dev, b, seq, tp, cp, L.ep, L.sp, L.attention)
    fwd, bwd = blk.with_recompute(L.recompute)
    layers = math.ceil(shape.layers / pp)
    tp_link = cluster.intra if tp <= G else cluster.inter
    parts: dict = {}
    # tensor parallelism: 2 all-reduces forward, 2 backward, 2 more forward under full recomputation
    tp_f = tp_b = 0.0
    if tp > 1:
        one = nccl_ring(tp, min(tp, G), act, cluster.intra, cluster.inter)
        tp_f, tp_b = 2 * one, (4 if L.recompute == "full" else 2) * one
        if L.tp_overlap:
            tp_f, tp_b = max(0.0, tp_f - blk.fwd_gemm), max(0.0, tp_b - blk.bwd_gemm)
    # context parallelism: K and V of the whole sequence gathered, their gradients reduce-scattered
    cp_f = cp_b = 0.0
    if cp > 1:
        kv = 2 * 2.0 * b * seq * shape.kv_heads * shape.d / tp
        cp_in = _per_node(cp, tp, G)
        cp_f = max(0.0, nccl_ring(cp, cp_in, kv, cluster.intra, cluster.inter, "all_gather") - blk.fwd_attn)
        cp_b = max(0.0, nccl_ring(cp, cp_in, kv, cluster.intra, cluster.inter, "reduce_scatter") - blk.bwd_attn)
    # expert parallelism: dispatch and combine all-to-alls, each (ep-1)/ep of the routed tokens leaving
    ep_f = 0.0
    if L.ep > 1:
        routed = T * shape.top_k * shape.hidden * 2.0 * (L.ep - 1) / L.ep
        ep_in = _per_node(L.ep, tp * cp, G)
        bw = cluster.intra.bandwidth if ep_in >= L.ep else min(cluster.intra.bandwidth, cluster.inter.bandwidth)
        ep_f = 2 * routed / (NET_EFF * bw)
    stage = layers * (fwd + bwd + tp_f + tp_b + cp_f + cp_b + 2 * ep_f) + head[0] + head[1]
    gemm, attn, elem = blk.kinds(L.recompute)
    slots = m + (pp - 1) / v  # stage times on the step's critical path
    parts["gemm"], parts["attn"], parts["elem"] = (slots * (layers * gemm + head[0]), slots * layers * attn,
                                                   slots * (layers * elem + head[1]))
    parts["tp_exposed"] = m * layers * (tp_f + tp_b)
    parts["cp_exposed"] = m * layers * (cp_f + cp_b)
    parts["ep"] = m * layers * 2 * ep_f
    p2p = 0.0
    if pp > 1:
        hop = cluster.inter if tp * cp * L.dp >= G else cluster.intra
        p2p = hop.alpha + act / (tp if L.sp else 1) / (NET_EFF * hop.bandwidth)
    pipe = (m + (pp - 1) / v) * stage + 2 * (pp - 1) * p2p
    parts["bubble"] = (pp - 1) / v * stage
    # data parallelism over dp x cp devices: gradients, ZeRO's weight gathers
    dense, expert = stage_params(shape, tp, pp, L.ep)
    N = dense + expert
    D = L.dp * cp
    d_in = _per_node(D, tp, G)
    ring = functools.partial(nccl_ring, D, d_in, intra=cluster.intra, inter=cluster.inter)
    first_fwd = layers * fwd
    last_bwd = layers * bwd
    if L.zero == 3:
        ag = ring(2.0 * N, collective="all_gather")
        rs = ring(4.0 * N, collective="reduce_scatter")
        dp_t = m * (2 * ag + rs)
        dp_exposed = m * (max(0.0, ag - first_fwd) + max(0.0, ag + rs - last_bwd)) + rs / layers \
            if L.dp_overlap else dp_t
    else:
        grads = ring(4.0 * N, collective="all_reduce" if L.zero == 0 else "reduce_scatter")
        gather = ring(2.0 * N, collective="all_gather") if L.zero else 0.0
        dp_t = grads + gather
        dp_exposed = (max(0.0, grads - last_bwd) + max(0.0, gather - first_fwd)) if L.dp_overlap else dp_t
    parts["dp_comm"], parts["dp_exposed"] = dp_t, dp_exposed
    opt = optimizer_time(dev, dense / (D if L.zero else 1) + expert / (max(1, D * tp // L.ep) if L.zero else 1))
    parts["optimizer"] = opt
    step = pipe + dp_exposed + opt
    flops = shape.model_flops_per_token(seq) * batch * seq
    n = cluster.size
    mem = memory(shape, tp=tp, pp=pp, cp=cp, dp=L.dp, ep=L.ep, zero=L.zero, micro_batch=b, seq=seq, microbatches=m,
                 recompute=L.recompute, sp=L.sp, vpp=v)
    parts["model_flops_per_device_s"] = flops / step / n
    # traffic per device and step: NVLink (tp, and dp/cp/ep inside a node) and the network port
    nvl = m * layers * (2 if L.recompute != "full" else 3) * 2 * (tp - 1) / tp * act if tp > 1 else 0.0
    dp_bytes = {0: 2 * 4.0, 1: 4.0 + 2.0, 2: 4.0 + 2.0, 3: m * (2 * 2.0 + 4.0)}[L.zero] * N * (D - 1) / D
    net = (dp_bytes if d_in < D else 0.0) + (2 * m * act / (tp if L.sp else 1) if pp > 1 and tp * cp * L.dp >= G else 0)
    nvl += dp_bytes if d_in >= D and D > 1 else 0.0
    link, busiest = ("nvlink", nvl) if nvl >= net else ("network", net)
    return Prediction(layout, step, batch * seq / step / n, flops / step / (n * dev.bf16_flops), mem,
                      mem.total <= dev.memory, link, busiest, parts)


@dataclass(frozen=True)
class Case:
    """One training configuration to predict: a model shape on a cluster in a layout."""
    shape: Shape
    cluster: Cluster
    layout: Layout
    batch: int  # global batch, sequences
    seq: int

    def predict(self, efficiency: str = "sustained") -> Prediction:
        """:func:`predict` with the device's sustained (fitted) or nominal (published kernel) efficiencies."""
        dev = self.cluster.device.sustained() if efficiency == "sustained" else self.cluster.device
        check(self.shape, self.cluster, self.layout, self.batch, self.seq)
        return predict(self.shape, replace(self.cluster, device=dev), self.layout, self.batch, self.seq)


METRICS = ("tokens_per_s_per_device", "tflops_per_device", "mfu", "step_s")


def metric(case: Case, pred: Prediction, name: str) -> float:
    """A published figure's counterpart: tokens/s per device, model TFLOP/s per device (Megatron's
    FLOPs), MFU (of the bf16 peak), or seconds per step."""
    if name == "tokens_per_s_per_device":
        return pred.tokens_per_s
    if name == "tflops_per_device":
        return pred.tokens_per_s * case.shape.model_flops_per_token(case.seq) / 1e12
    if name == "mfu":
        return pred.mfu
    if name == "step_s":
        return pred.step_s
    raise ConfigError(f"metric {name!r}: choose from {', '.join(METRICS)}")
