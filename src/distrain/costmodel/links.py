"""Links, placements and link presets of the cost model.

A :class:`Fabric` says where each rank runs (``placement[r]`` = its node) and what the links
are: every node has a full-duplex link to a non-blocking switch (an uplink and a downlink,
each ``inter`` or the node's own entry of ``node_links``), and ranks of one node share the
node's ``intra`` link (loopback, shared memory, PCIe or NVLink). ``gamma`` is the time to
reduce one byte (an element-wise add), which the schedules charge where the code adds.
``host``, when set, is one more resource that every message between nodes crosses: the
bytes per second that all nodes' traffic can share, because one machine's cores process the
packets of every node (an emulated cluster). It is measured, not fitted: ``distrain bench
link``'s shift sends on every link at once, and where each link then gets less than
``HOST_BOUND`` of its ping-pong bandwidth, the shift's total is that shared capacity
(:func:`fabric_from_model`). A real cluster's shift gives every link its rate: no host.
``fan_in``/``fan_out``, also measured (``bench link``'s fan, :mod:`distrain.bench.link.fan`), are what
a node's downlink/uplink delivers to k flows at once of n bytes each, over its ping-pong rate: below 1
where TCP loses bytes in a shallow queue that k flows (incast) or one long one overflow;
:meth:`Fabric.bandwidth` applies them.

Presets (``LINKS``/``INTRA``): bandwidth is the data rate of the standard or the vendor's
data sheet, as payload bytes per second per direction; α is a typical one-way small-message
latency through the software stack, *not* a data-sheet number (TCP over Ethernet: tens of
microseconds; RDMA: a few). Sources are in docs/cost_model.md. Calibrated values from
``distrain bench link`` (a JSON file) replace them for a real cluster.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from distrain.errors import ConfigError


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message
    bandwidth: float  # payload bytes per second, one direction
    source: str = ""

    @property
    def beta(self) -> float:
        return 1.0 / self.bandwidth


# Ethernet: IEEE 802.3 line rates; TCP/IP payload is 1448 of every 1538 bytes on the wire
# (MTU 1500, with preamble and inter-frame gap): 94.1 %.
_TCP = 1448 / 1538
LINKS = {
    "eth-100m": Link(50e-6, 100e6 / 8 * _TCP, "IEEE 802.3u 100 Mb/s, TCP payload"),
    "eth-1g": Link(50e-6, 1e9 / 8 * _TCP, "IEEE 802.3ab 1 Gb/s, TCP payload"),
    "eth-10g": Link(20e-6, 10e9 / 8 * _TCP, "IEEE 802.3ae 10 Gb/s, TCP payload"),
    "eth-100g": Link(10e-6, 100e9 / 8 * _TCP, "IEEE 802.3ba 100 Gb/s, TCP payload"),
    "ib-hdr": Link(2e-6, 200e9 / 8, "InfiniBand HDR 200 Gb/s (NVIDIA ConnectX-6 data sheet)"),
    # GPU clusters: one such port per GPU (DGX A100: 8 x HDR; DGX H100 and Meta's Grand Teton: 8 x 400 Gb/s)
    "ib-400g": Link(5e-6, 400e9 / 8, "InfiniBand NDR 400 Gb/s (NVIDIA ConnectX-7 data sheet)"),
    "roce-400g": Link(5e-6, 400e9 / 8, "400 GbE RoCE v2 (NVIDIA ConnectX-7 data sheet)"),
    "roce-200g": Link(5e-6, 200e9 / 8, "200 GbE RoCE v2 (NVIDIA ConnectX-6 data sheet)"),
}
INTRA = {
    "shm": Link(5e-6, 10e9, "one-core memory copy, ~10 GB/s (measure with distrain bench link)"),
    "pcie4": Link(5e-6, 32e9 * 0.8, "PCIe 4.0 x16: 16 GT/s x 16 lanes, 128b/130b, ~80 % after protocol overhead"),
    "nvlink3": Link(3e-6, 300e9, "NVIDIA A100 data sheet: NVLink 600 GB/s bidirectional = 300 GB/s per direction"),
    "nvlink4": Link(3e-6, 450e9, "NVIDIA H100/H200 data sheets: NVLink 900 GB/s bidirectional = 450 GB/s per direction"),
    "pcie5": Link(5e-6, 64e9 * 0.8, "PCIe 5.0 x16: 32 GT/s x 16 lanes, 128b/130b, ~80 % after protocol overhead"),
}
DEFAULT_GAMMA = 1.0 / 4e9  # s per byte added (float32 add ~ 4 GB/s of one operand on one core)
HOST = ("host", 0)  # the resource every message between nodes crosses when Fabric.host is set
HOST_BOUND = 0.9  # a shift giving each link less than this share of its ping-pong rate is host-bound


@dataclass(frozen=True)
class Fabric:
    placement: tuple[int, ...]  # node of every rank
    inter: Link
    intra: Link
    gamma: float = DEFAULT_GAMMA
    node_links: tuple[Link, ...] | None = None  # per-node inter links (e.g. a slow server link)
    host: float | None = None  # bytes/s shared by all traffic between nodes (one emulating machine)
    # a send leaves only once the receiver's "receive ready" notice has arrived (Gloo's TCP pair; sim.py):
    # a calibration by `distrain bench link` over torch's transport says so ("handshake" in its links' model)
    handshake: bool = False
    # TCP over a shallow queue: a node's downlink carrying k flows at once, whose connections carry n bytes in
    # the call, delivers B·e in all, e = fan_in[i][k-1] at fan_sizes[i] (interpolated in log n, held at the
    # ends; k past the measured: the last); its uplink the same with fan_out. Measured by `distrain bench
    # link`'s fan (bench/link/fan.py: TCP incast, a long flow). Empty: B for any k, max-min sharing's lossless link.
    fan_sizes: tuple[float, ...] = ()
    fan_in: tuple[tuple[float, ...], ...] = ()
    fan_out: tuple[tuple[float, ...], ...] = ()
    notes: dict = field(default_factory=dict, compare=False)

    @property
    def size(self) -> int:
        return len(self.placement)

    def link_of(self, node: int) -> Link:
        return self.node_links[node] if self.node_links else self.inter

    def path(self, src: int, dst: int) -> tuple[tuple, ...]:
        a, b = self.placement[src], self.placement[dst]
        if src == dst:
            return ()
        if a == b:
            return (("intra", a),)
        return (("up", a), ("down", b)) + ((HOST,) if self.host else ())

    def alpha(self, src: int, dst: int) -> float:
        a, b = self.placement[src], self.placement[dst]
        if a == b:
            return self.intra.alpha
        return max(self.link_of(a).alpha, self.link_of(b).alpha)

    def bandwidth(self, link: tuple, flows: int = 1, nbytes: float | None = None) -> float:
        """Bytes/s that ``link`` delivers in all while it carries ``flows`` flows at once whose connections
        carry ``nbytes`` in the call (None: not known, the link's rate)."""
        kind, node = link
        if kind == "host":
            return self.host
        if kind == "intra":
            return self.intra.bandwidth
        table = self.fan_in if kind == "down" else self.fan_out
        scale = fan_scale(self.fan_sizes, table, flows, nbytes) if table and nbytes is not None else 1.0
        return self.link_of(node).bandwidth * scale

    def with_placement(self, placement) -> "Fabric":
        return replace(self, placement=tuple(placement))


def fan_scale(sizes: tuple[float, ...], table: tuple[tuple[float, ...], ...], flows: int, nbytes: float) -> float:
    """e(k, n) of a fan table (Fabric.fan_in/fan_out): row i for sizes[i], column k-1 for k flows (k past
    the last column: the last), linear in log n between two sizes, the end's value outside them."""
    col = [row[min(max(flows, 1), len(row)) - 1] for row in table]
    if nbytes <= sizes[0]:
        return col[0]
    for i in range(1, len(sizes)):
        if nbytes < sizes[i]:
            w = math.log(nbytes / sizes[i - 1]) / math.log(sizes[i] / sizes[i - 1])
            return col[i - 1] + w * (col[i] - col[i - 1])
    return col[-1]


def block_placement(world: int, procs_per_node: int) -> tuple[int, ...]:
    """torchrun's layout: ranks i*K .. i*K+K-1 on node i."""
    if procs_per_node < 1:
        raise ConfigError(f"--procs-per-node must be >= 1, got {procs_per_node}")
    return tuple(r // procs_per_node for r in range(world))


def preset_fabric(world: int, procs_per_node: int, link: str, intra: str = "shm",
                  gamma: float = DEFAULT_GAMMA) -> Fabric:
    if link not in LINKS:
        raise ConfigError(f"--link: unknown preset {link!r}; choose from {', '.join(LINKS)}")
    if intra not in INTRA:
        raise ConfigError(f"--intra: unknown preset {intra!r}; choose from {', '.join(INTRA)}")
    return Fabric(block_placement(world, procs_per_node), LINKS[link], INTRA[intra], gamma)


def _link(d: dict, what: str) -> Link:
    try:
        return Link(float(d["alpha_us"]) * 1e-6, float(d["bandwidth_GBps"]) * 1e9, d.get("source", "calibrated"))
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"calibration: {what} needs alpha_us and bandwidth_GBps, got {d!r}") from None


def calibrated_fabric(path: str, placement) -> Fabric:
    """A Fabric from ``distrain bench link --json`` output (its "model" entry)."""
    try:
        with open(path) as f:
            model = json.load(f)["model"]
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise ConfigError(f"--predict: cannot read a calibration from {path!r} ({e}); "
                          f"write one with `distrain bench link --json {path}`") from None
    return fabric_from_model(model, placement)


def fan_efficiencies(model: dict) -> tuple[tuple[float, ...], tuple, tuple]:
    """(fan_sizes, fan_in, fan_out) of a calibration's model, sizes ascending (bench/link/fan.py), each
    efficiency in (0, 1]; ((), (), ()) for a calibration without a fan (written before it existed, or by
    hand): its links then share max-min at their full rate, as before. One flow (k = 1) of at most the
    ping-pong's largest size (the shift's bytes) keeps e = 1: the ping-pong measured that very flow, and β
    is fitted on it; its fan value there is only a noisier second sample of the same (one 1 MiB fan-out of
    2026-12-02 took 387 ms of a median, against 138 ms in the fan-in beside it). A longer one (a long-lived
    flow, whose window may overshoot the queue) takes the fan's."""
    fan = model.get("fan")
    if not fan or "in_efficiency" not in fan:
        return (), (), ()
    if not isinstance(fan.get("bytes"), list) or not all(isinstance(n, (int, float)) and n > 0 for n in fan["bytes"]):
        raise ConfigError(f"calibration: fan bytes must be a list of sizes, one per row, got {fan.get('bytes')!r}")
    order = sorted(range(len(fan["bytes"])), key=lambda i: fan["bytes"][i])
    pingpong = (model.get("shift") or {}).get("bytes", 0)
    tables = []
    for side in ("in", "out"):
        rows = fan[f"{side}_efficiency"]
        if len(rows) != len(order) or not all(
                row and all(isinstance(e, (int, float)) and 0 < e <= 1 for e in row) for row in rows):
            raise ConfigError(f"calibration: fan {side}_efficiency needs a row of numbers in (0, 1] per size, "
                              f"got {rows!r}")
        # one flow of a size the ping-pong sent (up to its largest: the shift's) is what β was fitted on: e = 1
        tables.append(tuple(tuple(1.0 if k == 0 and fan["bytes"][i] <= pingpong else float(e)
                                  for k, e in enumerate(rows[i])) for i in order))
    return tuple(float(fan["bytes"][i]) for i in order), tables[0], tables[1]


def fabric_from_model(model: dict, placement) -> Fabric:
    """A Fabric from a calibration's model dict ({inter, intra: {alpha_us, bandwidth_GBps, handshake},
    gamma_ns_per_byte, shift, fan}); a calibration written before ``handshake`` or ``fan`` existed has
    none, and predicts as then."""
    inter = _link(model["inter"], "inter") if model.get("inter") else None
    intra = _link(model["intra"], "intra") if model.get("intra") else INTRA["shm"]
    if inter is None:
        inter = intra  # one node: every message stays inside it
    host, shift = None, model.get("shift")
    # the shift's rate of bytes, its latency left out (bench link's shift_rates; a calibration written
    # before that field has the whole time's rate only)
    per_link = shift and (shift.get("per_link_bytes_GBps") or shift["per_link_GBps"])
    if shift and model.get("inter") and per_link * 1e9 < HOST_BOUND * inter.bandwidth:
        # all links busy at once got only this much in all
        host = float(shift.get("aggregate_bytes_GBps") or shift["aggregate_GBps"]) * 1e9
    fan_sizes, fan_in, fan_out = fan_efficiencies(model)
    return Fabric(tuple(placement), inter, intra, float(model.get("gamma_ns_per_byte", DEFAULT_GAMMA * 1e9)) * 1e-9,
                  host=host, handshake=any((model.get(k) or {}).get("handshake") is True for k in ("inter", "intra")),
                  fan_sizes=fan_sizes, fan_in=fan_in, fan_out=fan_out)
