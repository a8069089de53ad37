"""``distrain bench link``: calibrate α and β of every link by ping-pong, and γ of the adds.

Method: rank 0 ping-pongs with every other rank in turn (the others wait): for each size n
(``--sizes``), ``--warmup`` untimed round trips, then ``--iters`` timed ones, each a
blocking ``distrain.comm.send`` of n bytes followed by a blocking ``recv`` of n bytes back
(the peer mirrors it), timed with ``perf_counter`` on rank 0. One-way time t(n) = median
round trip / 2. The α-β model t(n) = α + n·β (Hockney 1994) is fitted per pair:

* β = least-squares slope of t(n) over the sizes >= 256 KiB (where the bytes dominate);
* α = t(smallest size) - smallest·β (the per-message cost: stack, Gloo, wake-ups).

Pairs are grouped by placement: "inter" (ranks on different nodes: the shaped link) and
"intra" (same node). Nodes are told apart by ``DISTRAIN_CLUSTER_NODE`` (set by ``distrain
cluster run``) or else the host name. The model of a group is the median α and β of its
pairs. γ (seconds per byte of an element-wise float32 add, the reduction of the
collectives) is timed on rank 0 on a 16 MiB buffer. ``--json`` writes the records and
``model`` = {inter, intra: {alpha_us, bandwidth_GBps, handshake}, gamma_ns_per_byte, shift}, which
``distrain bench comm --predict PATH`` and the cost model read.

Then a *shift*: every rank at once sends the largest size to rank r+1 and receives from
r-1 (mod P), ``--iters`` times; time = the slowest rank's, median; its bytes' time = that less
the latency the model gives one such message (α, twice over torch's transport: the receiver's
"receive ready" notice first: ``handshake`` in the link's model). Its per-link rate against
the ping-pong's bandwidth says whether the links still give their rate when all are busy;
where they do not, something they share is the limit. In an emulated cluster that is this
host's cores, which process every node's packets (``model["shift"]`` also records how busy
rank 0's host was, from /proc/stat; docs/cost_model.md).

Then a *fan* (:mod:`distrain.bench.link.fan`): k = 1..P-1 ranks send n bytes (each of ``--fan-sizes``,
default the largest size) into rank 0 at once, and rank 0 to k ranks at once; ``model["fan"]`` holds
each time, goodput and efficiency against the ping-pong's rate (TCP incast and a long flow over a
shallow queue), which the cost model applies to a link that carries k flows at once.

``--transport torch,shm,shm-python`` ping-pongs each pair over each transport in turn (a group
of all ranks per transport, as ``bench comm`` builds them) and prints the one-way times side by
side (``latency`` in the JSON); the first transport's times are the ones fitted.

Run it under a launcher (``distrain cluster run -- distrain bench link``) to measure a
cluster; without one it spawns ``--nproc`` local ranks (loopback: the "intra" link).
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from typing import TypedDict

import torch

from distrain.bench import common
from distrain.bench.comm.columns import DEEPSPEED, transport_groups
from distrain.bench.link import fan
from distrain.errors import ConfigError

FIT_FROM = 256 << 10


@dataclass(frozen=True)
class Settings:
    """What one calibration measures: messages of ``sizes`` bytes, ``warmup`` untimed and ``iters``
    timed round trips each, over each of ``transports`` in turn (the first one's times are fitted)."""

    sizes: tuple[int, ...]
    warmup: int
    iters: int
    transports: tuple[str, ...] = ("torch",)
    fan_sizes: tuple[int, ...] = ()  # the fan's message sizes (bench/link/fan.py); () = the largest of sizes

    def __post_init__(self) -> None:
        if not self.sizes:
            raise ConfigError("--sizes: give at least one message size")
        if self.iters < 1 or self.warmup < 0:
            raise ConfigError("--iters must be >= 1 and --warmup >= 0")
        if not self.transports:
            raise ConfigError("--transport: give at least one transport")


class Calibration(TypedDict):
    """Rank 0's result of :func:`measure` (the module docstring says what each entry holds)."""

    records: list[dict]  # one per pair (0, peer): placement, one-way times, fitted alpha and bandwidth
    model: dict  # {inter, intra: {alpha_us, bandwidth_GBps, source}, gamma_ns_per_byte, shift}
    placement: list[int]  # node index of every rank
    latency: list[dict]  # one-way times per pair and transport


def node_id() -> str:
    return os.environ.get("DISTRAIN_CLUSTER_NODE") or socket.gethostname()


def placement() -> list[int]:
    """Node index of every rank (nodes numbered in order of first appearance), via all_gather_data."""
    from distrain import comm

    names = comm.all_gather_data(node_id(), algorithm=None)
    order = {n: i for i, n in enumerate(dict.fromkeys(names))}
    return [order[n] for n in names]


def fit(sizes: list[int], one_way: list[float]) -> tuple[float, float]:
    """(α seconds, β seconds per byte) as in the module docstring."""
    pts = [(n, t) for n, t in zip(sizes, one_way) if n >= FIT_FROM] or list(zip(sizes, one_way))[-2:]
    if len(pts) < 2:
        raise ConfigError("--sizes: give at least two sizes >= 256K to fit β")
    mx = sum(n for n, _ in pts) / len(pts)
    mt = sum(t for _, t in pts) / len(pts)
    beta = sum((n - mx) * (t - mt) for n, t in pts) / sum((n - mx) ** 2 for n, _ in pts)
    if beta <= 0:  # noise swamped the slope (a loaded machine): the largest message's average cost
        beta = pts[-1][1] / pts[-1][0]
    alpha = max(0.0, one_way[0] - sizes[0] * beta)
    return alpha, beta


def gamma_add(nbytes: int = 16 << 20, reps: int = 7) -> float:
    a, b = torch.zeros(nbytes // 4), torch.ones(nbytes // 4)
    ts = [common.time_call(lambda: a.add_(b)) for _ in range(reps)]
    return common.median(ts) / nbytes


def _pingpong(rank: int, peer: int, sizes: list[int], warmup: int, iters: int, group=None) -> list[float]:
    """One-way seconds per size (median round trip / 2) between rank 0 and ``peer`` over ``group``."""
    from distrain import comm

    out = []
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8)
        ts = []
        for i in range(warmup + iters):
            t0 = time.perf_counter()
            if rank == 0:
                comm.send(buf, peer, tag=7, group=group)
                comm.recv(buf, peer, tag=7, group=group)
            else:
                comm.recv(buf, 0, tag=7, group=group)
                comm.send(buf, 0, tag=7, group=group)
            if i >= warmup:
                ts.append(time.perf_counter() - t0)
        out.append(common.median(ts) / 2)
    return out


def _cpu_times() -> list[int] | None:
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    except OSError:
        return None


def _shift(rank: int, P: int, n: int, iters: int) -> dict:
    """Every rank sends n bytes to rank+1 and receives n from rank-1 at once (module docstring)."""
    import torch.distributed as dist

    from distrain import comm

    out, back = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    ts, cpu0 = [], _cpu_times()
    for i in range(iters + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        works = [comm.irecv(back, (rank - 1) % P, tag=8), comm.isend(out, (rank + 1) % P, tag=8)]
        for w in works:
            w.wait()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if i:
            ts.append(t.item())
    cpu1, t = _cpu_times(), common.median(ts)
    res = {"bytes": n, "time_us": t * 1e6}
    shift_rates(res, P, 0.0)
    if cpu0 and cpu1:
        d = [b - a for a, b in zip(cpu0, cpu1)]
        res["host_busy"] = 1 - (d[3] + d[4]) / max(1, sum(d))
        res["host_softirq"] = d[6] / max(1, sum(d))
    return res


def shift_rates(shift: dict, P: int, latency_us: float) -> None:
    """Set the shift's rates: ``per_link_GBps``/``aggregate_GBps`` from its whole time (what the links
    carried, latency included: never above the links' rate), and ``per_link_bytes_GBps``/
    ``aggregate_bytes_GBps`` from its time less ``latency_us``, the part of it that is not bytes (the links'
    α, and the receiver's notice before it under a handshake), which the cost model compares with the
    ping-pong: on links of 25 ms one way a 4 MiB shift is 13 % latency, which would otherwise pass for a
    host that halves every link's rate. (The latter is an estimate: a fitted α that overshoots, on links
    of no delay, can put it a little above the link's rate.)"""
    whole = shift["time_us"] * 1e-6
    t = (shift["time_us"] - latency_us) * 1e-6
    if not t > 0:  # the latency is noise here: the bytes took no measurable time
        t, latency_us = whole, 0.0
    shift.update(latency_us=latency_us, per_link_GBps=shift["bytes"] / whole / 1e9,
                 aggregate_GBps=P * shift["bytes"] / whole / 1e9, per_link_bytes_GBps=shift["bytes"] / t / 1e9,
                 aggregate_bytes_GBps=P * shift["bytes"] / t / 1e9)


def measure(rank: int, settings: Settings) -> Calibration | None:
    """Calibrate the links of the current world (module docstring). Collective: every rank of the
    initialised world calls it with the same ``settings``; rank 0 gets the :class:`Calibration`,
    the others None. ``bench link`` and ``bench comm --predict`` (no file) both run it."""
    import torch.distributed as dist

    where = placement()
    P = dist.get_world_size()
    sizes, transports = list(settings.sizes), list(settings.transports)
    groups = transport_groups(transports, P)
    records, latency = [], []
    for peer in range(1, P):
        dist.barrier()
        if rank not in (0, peer):
            continue
        times = {name: _pingpong(rank, peer, sizes, settings.warmup, settings.iters, groups[name])
                 for name in transports}
        if rank != 0:
            continue
        latency += [{"pair": [0, peer], "transport": name, "sizes": sizes, "one_way_us": [x * 1e6 for x in t]}
                    for name, t in times.items()]
        t = times[transports[0]]  # the first transport's times are the link the model fits
        alpha, beta = fit(sizes, t)
        kind = "intra" if where[0] == where[peer] else "inter"
        records.append({"pair": [0, peer], "nodes": [where[0], where[peer]], "kind": kind,
                        "sizes": sizes, "one_way_us": [x * 1e6 for x in t],
                        "alpha_us": alpha * 1e6, "bandwidth_GBps": 1 / beta / 1e9})
        common.progress(f"[link] 0 <-> {peer} ({kind}): alpha {alpha * 1e6:.1f} us, "
                        f"{1 / beta / 1e9:.4f} GB/s ({8 / beta / 1e6:.0f} Mbit/s)")
    dist.barrier()
    shift = _shift(rank, P, max(sizes), settings.iters)
    fan_res = fan.measure(rank, P, sorted(settings.fan_sizes or (max(sizes),)), settings.iters)
    if rank != 0:
        return None
    model: dict = {"gamma_ns_per_byte": gamma_add() * 1e9, "shift": shift, "fan": fan_res}
    for kind in ("inter", "intra"):
        rs = [r for r in records if r["kind"] == kind]
        if rs:
            model[kind] = {"alpha_us": common.median([r["alpha_us"] for r in rs]),
                           "bandwidth_GBps": common.median([r["bandwidth_GBps"] for r in rs]),
                           "source": f"distrain bench link, median of {len(rs)} pair(s)",
                           # torch's transport is Gloo's TCP pair, whose sends wait for the receiver's
                           # "receive ready" notice (costmodel/sim.py)
                           "handshake": transports[0] == "torch"}
    if "inter" in model:  # a shift message, posted with its receive, pays that notice's α before its own
        shift_rates(shift, P, model["inter"]["alpha_us"] * (2 if model["inter"]["handshake"] else 1))
    link = model.get("inter") or model["intra"]  # the fans' messages pay its latency as the shift's do
    fan.efficiencies(fan_res, link["alpha_us"] * (2 if link["handshake"] else 1), link["bandwidth_GBps"])
    return Calibration(records=records, model=model, placement=where, latency=latency)


def calibrate(settings: Settings, nproc: int) -> Calibration | None:
    """Run the calibration: under a launcher in this world (None on ranks other than 0), else on
    ``nproc`` spawned local ranks."""
    from distrain import runtime

    if runtime.launched_rank(os.environ) is not None:
        runtime.init(timeout=600)
        import torch.distributed as dist

        try:
            return measure(dist.get_rank(), settings)
        finally:
            runtime.shutdown()
    import distrain

    return distrain.spawn(measure, nproc, args=(settings,), timeout=600)[0]


def run(sizes: list[int], warmup: int, iters: int, nproc: int, json_path: str | None = None,
        transports: tuple[str, ...] = ("torch",), fan_sizes: tuple[int, ...] = ()) -> int:
    """Calibrate with messages of ``sizes`` bytes (``warmup`` untimed and ``iters`` timed round trips
    each, ``nproc`` local ranks when not launched) over ``transports`` (the first is fitted); print the
    fitted links and the one-way times, write ``json_path``."""
    if nproc < 2:
        raise ConfigError(f"--nproc must be >= 2 (a ping-pong needs two ranks), got {nproc}")
    if DEEPSPEED in transports:
        raise ConfigError(f"--transport {DEEPSPEED}: DeepSpeed's shared-memory op is an all_reduce; it has no "
                          f"point-to-point messages to time")
    settings = Settings(tuple(sizes), warmup, iters, tuple(transports), tuple(fan_sizes))
    res = calibrate(settings, nproc)
    if res is None:  # not rank 0
        return 0
    for kind in ("inter", "intra"):
        m = res["model"].get(kind)
        if m:
            print(f"{kind}: alpha = {m['alpha_us']:.1f} us, bandwidth = {m['bandwidth_GBps']:.4f} GB/s")
    print(f"gamma (float32 add) = {res['model']['gamma_ns_per_byte']:.3f} ns/byte")
    if len(transports) > 1:
        print("one-way time, us (rank 0 <-> " + ", ".join(str(r["pair"][1]) for r in res["records"]) + "; median)")
        print(f"{'size':>8} " + " ".join(f"{t:>12}" for t in transports))
        for i, n in enumerate(sizes):
            cells = [common.median([r["one_way_us"][i] for r in res["latency"] if r["transport"] == t])
                     for t in transports]
            print(f"{common.format_size(n):>8} " + " ".join(f"{c:>12.1f}" for c in cells))
    sh = res["model"]["shift"]
    busy = (f"; rank 0's host CPU {sh['host_busy']:.0%} busy ({sh['host_softirq']:.0%} softirq)"
            if "host_busy" in sh else "")
    fr = res["model"]["fan"]
    for i, n in enumerate(fr["bytes"]):
        print(f"fan of {common.format_size(n)} per flow, k = " + ", ".join(map(str, fr["senders"])) + " flows at once: "
              "goodput over the ping-pong's into one rank " + ", ".join(f"{e:.2f}" for e in fr["in_efficiency"][i]) +
              "; out of one rank " + ", ".join(f"{e:.2f}" for e in fr["out_efficiency"][i]))
    print(f"shift (every rank sends {sh['bytes'] >> 10} KiB to the next at once): {sh['per_link_GBps']:.4f} GB/s per "
          f"link, {sh['aggregate_GBps']:.4f} GB/s in all"
          + (f" ({sh['per_link_bytes_GBps']:.4f} per link without its {sh['latency_us'] / 1e3:.1f} ms of latency)"
             if sh.get("latency_us") else "") + busy)
    if json_path:
        meta = common.metadata(benchmark="link", sizes=list(settings.sizes), warmup=settings.warmup,
                               iters=settings.iters, placement=res["placement"], transports=list(settings.transports),
                               fan_sizes=list(settings.fan_sizes))
        with open(json_path, "w") as f:
            json.dump({"meta": meta, "records": res["records"], "model": res["model"], "latency": res["latency"]},
                      f, indent=1)
        common.progress(f"wrote {json_path}")
    return 0
