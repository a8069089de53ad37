"""How each timed sample of ``distrain bench comm`` starts: a common instant (``--start window``) or a barrier.

The cost model (:mod:`distrain.costmodel.sim`) starts every rank of a collective at time 0 and ends
it at its last arrival. ``--start window`` measures that interval, the way ReproMPI's window-based
synchronisation does (Hunold & Carpen-Amarie, "Reproducible MPI benchmarking is still not as easy
as you think", IEEE TPDS 2016):

1. once per cell, every rank's clock offset to rank 0 (:func:`estimate_offset`): rank 0 ping-pongs
   with each rank in turn over the process group's point-to-point sends, ``SYNC_ROUNDS`` times, and
   the sample with the shortest round trip gives the offset, NTP's way (:func:`ntp_offset`: RFC 5905,
   offset = ((t1 - t0) + (t2 - t3)) / 2; its error is at most half that round trip's asymmetry);
2. before each sample (:meth:`Starter.begin`): an all-reduce (every rank has ended the last sample),
   then rank 0 fixes a start ``T = now + margin`` on its clock and broadcasts it; each rank waits
   until ``T`` on its own clock corrected by its offset (:func:`wait_until`: sleep, then spin the
   last ``SPIN_S``), and times the sample from ``T`` to its own end. The margin is
   :func:`next_margin`: twice the longest time any rank took to learn ``T`` so far (the all-reduce's
   exit skew plus the broadcast's latency), at least ``MIN_MARGIN_S``; the first is
   ``FIRST_MARGIN_RTTS`` of the longest sync round trip per broadcast hop;
3. each rank's lateness past ``T`` (a broadcast that came after ``T``, or a late wake-up) is kept:
   the records carry the start's skew between ranks and the late samples.

``--start barrier`` is the method before it: a native barrier, then each rank times from its own
exit. Its ranks leave the barrier up to one link latency apart per round (a dissemination barrier
over Gloo's TCP pairs), so with latency the slowest rank's time holds that skew; the offsets are
estimated too, and its records carry the barrier's measured exit skew.
"""

from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch

MODES = ("window", "barrier")
SYNC_ROUNDS = 10  # ping-pongs per rank for its offset (the shortest round trip's is kept)
MIN_MARGIN_S = 1e-3  # the shortest time between fixing a start and the start
FIRST_MARGIN_RTTS = 4.0  # the first margin: this many of the longest sync round trip per broadcast hop
SPIN_S = 2e-3  # sleep until this long before the start, then spin


def ntp_offset(samples: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(offset, round trip) of the sample with the shortest round trip; each sample is NTP's
    (t0 client sends, t1 server receives, t2 server replies, t3 client receives), t0 and t3 on the
    client's clock, t1 and t2 on the server's. offset = server clock - client clock."""
    if not samples:
        raise ValueError("ntp_offset: no samples")
    best = min(samples, key=lambda s: (s[3] - s[0]) - (s[2] - s[1]))
    t0, t1, t2, t3 = best
    return ((t1 - t0) + (t2 - t3)) / 2.0, (t3 - t0) - (t2 - t1)


def estimate_offset(dist, rank: int, P: int, clock: Callable[[], float] = time.perf_counter,
                    rounds: int = SYNC_ROUNDS) -> tuple[float, float]:
    """Collective over the default group: this rank's (offset to rank 0's clock, shortest round trip) in
    seconds (rank 0: (0, 0)). Every receive is posted before its sender can send (Gloo's pair holds a
    send until the receiver's "receive ready" notice, which would lengthen one direction only)."""
    f64 = torch.float64
    if rank == 0:
        for peer in range(1, P):
            ping = torch.zeros(1, dtype=f64)
            req = dist.irecv(ping, src=peer)
            for k in range(rounds):
                req.wait()
                t1 = clock()
                if k + 1 < rounds:
                    ping = torch.zeros(1, dtype=f64)
                    req = dist.irecv(ping, src=peer)
                t2 = clock()
                dist.send(torch.tensor([t1, t2], dtype=f64), dst=peer)
        return 0.0, 0.0
    samples = []
    for _ in range(rounds):
        reply = torch.zeros(2, dtype=f64)
        req = dist.irecv(reply, src=0)
        t0 = clock()
        dist.send(torch.tensor([t0], dtype=f64), dst=0)
        req.wait()
        t3 = clock()
        samples.append((t0, float(reply[0]), float(reply[1]), t3))
    return ntp_offset(samples)


def wait_until(deadline: float, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep, spin: float = SPIN_S) -> float:
    """Wait until ``clock()`` reaches ``deadline``: sleep until ``spin`` before it, then spin. Returns how
    late it returned (>= 0: a deadline already past, or a sleep that overslept past it)."""
    ahead = deadline - clock() - spin
    if ahead > 0:
        sleep(ahead)
    now = clock()
    while now < deadline:
        now = clock()
    return now - deadline


def first_margin(max_rtt: float, P: int) -> float:
    """The first sample's margin: FIRST_MARGIN_RTTS round trips per hop of a binomial broadcast."""
    return max(MIN_MARGIN_S, FIRST_MARGIN_RTTS * max_rtt * max(1, math.ceil(math.log2(max(P, 2)))))


def next_margin(margin: float, worst_lag: float, first: bool) -> float:
    """The next margin, the same on every rank (from the all-reduced worst lag): twice the longest time a
    rank has taken to learn the start (``worst_lag``, the maximum so far), at least MIN_MARGIN_S; until a
    lag is known (``first``), ``margin`` as it is."""
    return margin if first else max(MIN_MARGIN_S, 2.0 * worst_lag)


class Starter:
    """One rank's start of each timed sample; collective: every rank calls :meth:`sync` and
    :meth:`begin` alike. ``begin`` returns the sample's start on this rank's clock, the instant its
    time is measured from; ``start`` (rank 0's clock) and ``late`` describe the last one."""

    def __init__(self, mode: str, dist, rank: int, P: int, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep):
        if mode not in MODES:
            raise ValueError(f"start mode {mode!r}: expected one of {MODES}")
        self.mode, self.dist, self.rank, self.P, self.clock, self.sleep = mode, dist, rank, P, clock, sleep
        self.offset = self.rtt = 0.0
        self.margin: float | None = None
        self.worst_lag = 0.0  # the longest any rank took to learn a start, so far (all-reduced)
        self.lag = 0.0  # this rank's, for the last start
        self.start = self.late = 0.0

    def sync(self) -> dict:
        """Estimate this rank's offset to rank 0 (collective); returns every rank's offset and round trip."""
        self.offset, self.rtt = estimate_offset(self.dist, self.rank, self.P, self.clock)
        mine = torch.tensor([self.offset, self.rtt], dtype=torch.float64)
        every = [torch.empty_like(mine) for _ in range(self.P)]
        self.dist.all_gather(every, mine)
        rtts = [float(t[1]) for t in every]
        if self.margin is None:
            self.margin = first_margin(max(rtts), self.P)
        return {"offset_us": [float(t[0]) * 1e6 for t in every], "rtt_us": [r * 1e6 for r in rtts]}

    def begin(self) -> float:
        """Start a sample; returns its start on this rank's clock."""
        if self.mode == "barrier":
            self.dist.barrier()
            t = self.clock()
            self.start, self.late = t + self.offset, 0.0
            return t
        lag = torch.tensor([self.lag], dtype=torch.float64)
        self.dist.all_reduce(lag, op=self.dist.ReduceOp.MAX)  # every rank has ended the last sample
        first = self.worst_lag == 0.0 and float(lag) == 0.0
        self.worst_lag = max(self.worst_lag, float(lag))
        self.margin = next_margin(self.margin or MIN_MARGIN_S, self.worst_lag, first)
        fixed = self.clock() + self.offset  # on rank 0's clock (offset 0 there)
        start = torch.tensor([fixed + self.margin if self.rank == 0 else 0.0], dtype=torch.float64)
        self.dist.broadcast(start, src=0)
        learned = self.clock() + self.offset
        self.start = float(start)
        self.lag = max(0.0, learned - (self.start - self.margin))
        local = self.start - self.offset
        self.late = wait_until(local, self.clock, self.sleep)
        return local

    def actual_start(self) -> float:
        """The last sample's actual start on rank 0's clock (its start plus this rank's lateness)."""
        return self.start + self.late


LATE_S = 1e-3  # a rank that started this much after the common start makes its sample a late one


def summary(mode: str, starts: Sequence[Sequence[float]], late: Sequence[Sequence[float]]) -> dict:
    """A record's ``start``: from every rank's actual start ([rank][sample], rank 0's clock) and lateness
    past the common start ([rank][sample], seconds), the skew between ranks' starts per sample (latest -
    earliest) in µs, its median and maximum, and the samples some rank started over LATE_S late."""
    skew = sorted((max(col) - min(col)) * 1e6 for col in zip(*starts))
    n = len(skew)
    worst = [max(col) for col in zip(*late)]
    return {"mode": mode, "skew_us_median": (skew[(n - 1) // 2] + skew[n // 2]) / 2 if n else None,
            "skew_us_max": skew[-1] if n else None, "late_us_max": max(worst) * 1e6 if worst else None,
            "late_samples": sum(w > LATE_S for w in worst)}
