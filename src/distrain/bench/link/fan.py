"""``distrain bench link``'s fan-in and fan-out: what one node's link delivers to k flows at once.

The α-β links of the cost model share a link max-min fairly among the flows on it, at the
link's ping-pong rate in all: k flows into one receiver (a star's or tree's root in its reduce:
*incast*) or out of one sender (its broadcast) get B/k each. TCP over a shallow queue does not:
k senders whose windows together exceed what the receiver's link and its queue hold overflow the
queue, which tail-drops; the senders retransmit and some wait for a probe or a retransmission
time-out, during which the link idles (TCP incast: Phanishayee et al., "Measurement and Analysis
of TCP Throughput Collapse in Cluster-based Storage Systems", FAST'08; Vasudevan et al., "Safe and
Effective Fine-grained TCP Retransmissions for Datacenter Communication", SIGCOMM'09). The
emulated cluster's default queue is 50 ms (one bandwidth-delay product at 25 ms one way), so
there 2-3 flows into one node already lose 7-13 % of their bytes (docs/cost_model.md).

So this measures it, as α and β are measured: for each size n of ``--fan-sizes`` (default the
largest of ``--sizes``; the sizes the collectives send: a star's all-reduce of N sends N per flow)
and k = 1 .. P-1, ranks 1..k each send n bytes to rank 0 at once (fan-in), then rank 0 sends n
bytes to each of them at once (fan-out), ``iters`` times after a warm-up; time = the slowest rank's,
median (as the shift). The goodput of k flows is k·n / (time − latency), the latency being one such
message's (α, and α more for the receiver's notice over Gloo's TCP pair), and the *efficiency*
e(k, n) is that goodput over the link's ping-pong bandwidth B, at most 1. k = 1 at a large n is a
long-lived single flow, whose window can overshoot the queue on its own. The cost model
(:class:`distrain.costmodel.links.Fabric`) gives a node's downlink carrying k flows at once
B·e_in(k, n) in all and its uplink B·e_out(k, n), n being the bytes the flows' connections carry in
the call (TCP sees a pair's back-to-back messages as one transfer), interpolated in log n between
the measured sizes and held at the ends; k beyond the measured fan-out takes the largest k's.
"""

from __future__ import annotations

import time

import torch

from distrain.bench import common


def _fan_once(rank: int, k: int, n: int, into: bool) -> float:
    """Seconds on this rank of one k-way fan of n bytes per flow (into rank 0, or out of it)."""
    from distrain import comm

    t0 = time.perf_counter()
    if rank == 0:
        bufs = [torch.zeros(n, dtype=torch.uint8) for _ in range(k)]
        works = [(comm.irecv if into else comm.isend)(bufs[j - 1], j, tag=9) for j in range(1, k + 1)]
    elif rank <= k:
        buf = torch.zeros(n, dtype=torch.uint8)
        works = [(comm.isend if into else comm.irecv)(buf, 0, tag=9)]
    else:
        works = []
    for w in works:
        w.wait()
    return time.perf_counter() - t0


def measure(rank: int, P: int, sizes: list[int], iters: int) -> dict:
    """Every rank calls it; rank 0's result is {"bytes": sizes, "senders": [1..P-1], "in_time_us",
    "out_time_us": [per size [per k]]} (medians of the slowest rank's time); :func:`efficiencies`
    adds the rates once the links' latency and bandwidth are known."""
    import torch.distributed as dist

    res: dict = {"bytes": list(sizes), "senders": list(range(1, P)), "in_time_us": [], "out_time_us": []}
    for n in sizes:
        for into, key in ((True, "in_time_us"), (False, "out_time_us")):
            times = []
            for k in range(1, P):
                ts = []
                for i in range(iters + 1):  # the first is a warm-up
                    dist.barrier()
                    t = torch.tensor([_fan_once(rank, k, n, into)], dtype=torch.float64)
                    dist.all_reduce(t, op=dist.ReduceOp.MAX)
                    if i:
                        ts.append(t.item())
                times.append(common.median(ts) * 1e6)
            res[key].append(times)
    return res


def efficiencies(fan: dict, latency_us: float, bandwidth_GBps: float) -> None:
    """Set ``fan``'s goodputs (``in_goodput_GBps``, ``out_goodput_GBps``: per size, per k, k·n over the
    time less ``latency_us``) and ``in_efficiency``/``out_efficiency``: each over ``bandwidth_GBps`` (the
    link's ping-pong rate, recorded as ``bandwidth_GBps``), at most 1 (the module docstring)."""
    fan["latency_us"], fan["bandwidth_GBps"] = latency_us, bandwidth_GBps
    for side in ("in", "out"):
        good = []
        for n, row in zip(fan["bytes"], fan[f"{side}_time_us"]):
            rates = []
            for k, t in zip(fan["senders"], row):
                dt = t - latency_us
                rates.append(k * n / ((dt if dt > 0 else t) * 1e-6) / 1e9)
            good.append(rates)
        fan[f"{side}_goodput_GBps"] = good
        fan[f"{side}_efficiency"] = [[min(1.0, g / bandwidth_GBps) for g in row] for row in good]
