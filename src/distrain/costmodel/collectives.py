"""Closed-form α-β times of ring collectives, with links shared by concurrent groups.

A ring collective of P ranks has one phase (all-gather, reduce-scatter) or two (all-reduce:
reduce-scatter, then all-gather; Patarasuk & Yuan 2009); in each, every chunk travels P - 1
consecutive hops and every hop forwards P - 1 chunks, one after another, in pieces of up to
1 MiB (distrain's ring). :func:`ring_time` counts, for all the groups running at once on one
:class:`~distrain.costmodel.links.Fabric`, the messages that share each link in a step, so a
hop's chunk moves at the share of its most loaded link, min over its links of B / n (max-min
fairness gives no message less: Bertsekas & Gallager, Data Networks, 6.5.2). A phase then takes
the longer of

* the chain: a piece's latency α, transfer and add (γ per byte, reduce-scatter only) summed
  over its P - 1 hops, plus the chunk's other pieces behind it at the slowest hop's pace;
* the slowest hop's work: P - 1 chunks at its rate, plus one α and one add.

For a ring of equal hops this is 2(P-1)(α + N/(P·B)) (all-reduce), the seeds' closed form. On a
fabric with a ``handshake`` (Gloo's TCP pair: a send leaves once the receiver's "receive ready"
notice has arrived, :mod:`distrain.costmodel.sim`) a call adds one more α: its first pieces wait
for the notices of receives posted when it starts; the ring posts every later receive, the
all-gather's included, before the first send, so no later piece waits on one.
It is the coarse path of ``distrain plan``; the flow simulator (:mod:`distrain.costmodel.sim`)
replays every piece. The measured difference (docs/cost_model.md, "Speed"): within 1 % on the
27 calibrated ring cells of the emulated cluster, median 0.07 % and at most 24 % over 360
synthetic cases, the largest where the chain and the slowest hop take about equally long.

:func:`nccl_ring` is the same count for a GPU cluster's hierarchical rings (NCCL): a group of n
GPUs with k of them in each node moves each chunk over NVLink inside a node and over the k
members' own NICs between nodes (one channel per NIC), so its bus bandwidth is
min(B_intra, k · B_nic), derated by :data:`NET_EFF`.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from distrain.comm.algorithms.cost import chunk_sizes
from distrain.costmodel.links import Fabric, Link

# nccl-tests bus bandwidth at large sizes over the data-sheet rate: all_reduce_perf on 8 A100 SXM4 over NVLink3
# reaches 230-250 of 300 GB/s ("NCCL-tests in practice", docs.alayanew.com tech blog, 2026-05-06, reference table;
# busbw as nccl-tests' PERFORMANCE.md defines it)
NET_EFF = 0.8
PIECE_BYTES, MAX_PIECES = 1 << 20, 16  # as distrain.comm.algorithms.ring
STEPS = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}


def ring_time(fabric: Fabric, groups: Sequence[Sequence[int]], nbytes: float, collective: str = "all_reduce",
              elem: int = 4) -> tuple[float, float]:
    """(seconds, bytes on the busiest link) of a ring ``collective`` of ``nbytes`` (the whole
    buffer; for all-gather/reduce-scatter P times a rank's part) in every group at once."""
    P = len(groups[0])
    if P < 2 or nbytes <= 0:
        return 0.0, 0.0
    count = int(nbytes // elem)
    if collective == "all_reduce":  # tensor_split's chunks; a rank sends all but chunk i (reduce-scatter)
        chunks = chunk_sizes(count, P)  # and all but chunk i+1 (all-gather)
        sent = [(2 * count - chunks[i] - chunks[(i + 1) % P]) * elem for i in range(P)]
    else:  # count / P elements per rank, P - 1 of them sent
        chunks = [count // P] * P
        sent = [(P - 1) * count // P * elem] * P
    chunk = max(chunks) * elem
    users: Counter = Counter()
    carried: Counter = Counter()
    hops = []
    for g in groups:
        for i, src in enumerate(g):
            path = fabric.path(src, g[(i + 1) % P])
            users.update(path)
            hops.append((fabric.alpha(src, g[(i + 1) % P]), path))
            for link in path:
                carried[link] += sent[i]
    pieces = min(MAX_PIECES, max(1, -(-chunk // PIECE_BYTES)))  # the ring forwards a chunk in pieces
    add = fabric.gamma * chunk / pieces if collective in ("all_reduce", "reduce_scatter") else 0.0
    # per hop: its latency and its chunk at its share of its most loaded link
    # (a pair's connection carries its sent bytes in the call: what a fan-calibrated link's rate depends on)
    per = [(a, chunk / min(fabric.bandwidth(link, users[link], max(sent)) / users[link] for link in path))
           for a, path in hops]
    slowest = max(x for _, x in per)
    seconds = 0.0
    for phase_add in ((add, 0.0) if collective == "all_reduce" else (add,)):
        # a piece's chain: P - 1 consecutive hops of its group's ring (latency, transfer, add), then the
        # chunk's other pieces behind it at the slowest hop's pace
        t = [a + x / pieces + phase_add for a, x in per]
        chain = max(sum(t[k * P:(k + 1) * P]) - min(t[k * P:(k + 1) * P]) for k in range(len(groups)))
        chain += (pieces - 1) * slowest / pieces
        # the slowest hop carries P - 1 chunks one after the other
        busy = (P - 1) * slowest + max(a for a, _ in per) + phase_add
        seconds += max(chain, busy)
    if fabric.handshake:  # every first piece waits for its receiver's "receive ready" notice, once per call
        seconds += max(fabric.alpha(g[(i + 1) % P], src) for g in groups for i, src in enumerate(g))
    busiest = max((b for link, b in carried.items() if link[0] != "host"), default=0.0)
    return seconds, float(busiest)


def nccl_ring(n: int, per_node: int, nbytes: float, intra: Link, inter: Link, collective: str = "all_reduce") -> float:
    """Seconds of a ring ``collective`` of ``nbytes`` (whole buffer) over ``n`` GPUs, ``per_node`` of
    them in each node (n == per_node: one node)."""
    if n < 2 or nbytes <= 0:
        return 0.0
    one_node = per_node >= n
    bw = intra.bandwidth if one_node else min(intra.bandwidth if per_node > 1 else float("inf"),
                                              per_node * inter.bandwidth)
    alpha = intra.alpha if one_node else inter.alpha
    steps = STEPS[collective] * (n - 1)
    return steps * (alpha + nbytes / n / (NET_EFF * bw))
