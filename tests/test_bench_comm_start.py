"""`distrain bench comm --start`: the clock offsets' NTP estimate and the common start of each sample,
in-process on a fake network whose ranks keep virtual time (deterministic whatever the threads do),
and the offset once over real Gloo with a shifted clock."""

from __future__ import annotations

import math
import queue
import threading
import types

import pytest
import torch

from distrain.bench.comm import start


# -- a fake network: per rank a virtual true time; each clock reads it plus the rank's offset ----------

class FakeNet:
    """P ranks joined by FIFO pairs; a message sent at true time t arrives at t + delay(src, dst, k)
    (k: its index on that pair); a receiver's true time becomes at least the arrival. Every clock
    read advances its rank by ``tick``; a sleep advances it by the time asked (plus ``oversleep``)."""

    def __init__(self, P: int, offsets, delay, tick: float = 1e-6, oversleep: float = 0.0):
        self.P, self.offsets, self.delay, self.tick, self.oversleep = P, offsets, delay, tick, oversleep
        self.t = [0.0] * P
        self.q = {(a, b): queue.Queue() for a in range(P) for b in range(P) if a != b}
        self.sent = {k: 0 for k in self.q}

    def dist(self, rank: int) -> "FakeDist":
        return FakeDist(self, rank)


class FakeDist:
    ReduceOp = types.SimpleNamespace(MAX="max")

    def __init__(self, net: FakeNet, rank: int):
        self.net, self.rank = net, rank

    def clock(self) -> float:
        self.net.t[self.rank] += self.net.tick
        return self.net.t[self.rank] + self.net.offsets[self.rank]

    def sleep(self, dt: float) -> None:
        self.net.t[self.rank] += dt + self.net.oversleep

    def send(self, tensor, dst):
        key = (self.rank, dst)
        k = self.net.sent[key]
        self.net.sent[key] += 1
        self.net.q[key].put((self.net.t[self.rank] + self.net.delay(self.rank, dst, k), tensor.clone()))

    def irecv(self, tensor, src):
        net, rank = self.net, self.rank

        class Req:
            def wait(self):
                arrival, data = net.q[(src, rank)].get(timeout=30)
                tensor.copy_(data)
                net.t[rank] = max(net.t[rank], arrival)

        return Req()

    def recv(self, tensor, src):
        self.irecv(tensor, src).wait()

    def broadcast(self, tensor, src):
        if self.rank == src:
            for d in range(self.net.P):
                if d != src:
                    self.send(tensor, d)
        else:
            self.recv(tensor, src)

    def all_gather(self, out, tensor):
        every = torch.stack([tensor] * self.net.P)
        if self.rank == 0:
            for s in range(1, self.net.P):
                self.recv(every[s], s)
        else:
            self.send(tensor, 0)
        self.broadcast(every, 0)
        for o, t in zip(out, every):
            o.copy_(t)

    def all_reduce(self, tensor, op=None):
        out = [torch.empty_like(tensor) for _ in range(self.net.P)]
        self.all_gather(out, tensor)
        tensor.copy_(torch.stack(out).max(dim=0).values)

    def barrier(self):
        self.all_reduce(torch.zeros(1))


def run_ranks(net: FakeNet, fn):
    """fn(rank, dist) on a thread per rank; their results by rank (an exception fails the test)."""
    out, errors = [None] * net.P, []

    def body(r):
        try:
            out[r] = fn(r, net.dist(r))
        except BaseException as e:  # noqa: BLE001 (re-raised below, on the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(net.P)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    return out


# -- the NTP estimate ----------------------------------------------------------------------------

def test_ntp_offset_takes_the_shortest_round_trip():
    theta = 123.456  # server clock - client clock

    def sample(t0, fwd, proc, back):  # t0 on the client's clock; delays in true seconds
        t1 = t0 + fwd + theta
        return (t0, t1, t1 + proc, t0 + fwd + proc + back)

    samples = [sample(0.0, 0.040, 0.001, 0.010),  # slow out: offset read 15 ms high
               sample(1.0, 0.010, 0.002, 0.010),  # symmetric, the shortest: exact
               sample(2.0, 0.010, 0.000, 0.030)]  # slow back: offset read 10 ms low
    offset, rtt = start.ntp_offset(samples)
    assert offset == pytest.approx(theta, abs=1e-9) and rtt == pytest.approx(0.020, abs=1e-9)
    assert start.ntp_offset(samples[:1])[0] == pytest.approx(theta + 0.015, abs=1e-9)  # half the asymmetry
    with pytest.raises(ValueError):
        start.ntp_offset([])


def test_estimate_offset_over_a_fake_network():
    """Three ranks with clocks 5 s ahead and 3 s behind rank 0's; 10 ms each way, but the first message of
    each pair 30 ms (a handshake) and rank 2's sixth ping 50 ms: each estimate is exact, from a sample
    with neither."""
    offsets = [0.0, 5.0, -3.0]

    def delay(src, dst, k):
        return 0.030 if k == 0 else 0.050 if (src, k) == (2, 5) else 0.010

    net = FakeNet(3, offsets, delay)
    got = run_ranks(net, lambda r, d: start.estimate_offset(d, r, 3, d.clock))
    assert got[0] == (0.0, 0.0)
    for r in (1, 2):
        offset, rtt = got[r]
        assert offset == pytest.approx(offsets[0] - offsets[r], abs=1e-9)
        assert rtt == pytest.approx(0.020, abs=1e-5)


# -- the wait and the margin ---------------------------------------------------------------------

def test_wait_until_sleeps_then_spins_and_says_how_late():
    now = [9.0]
    slept = []

    def clock():
        now[0] += 1e-6
        return now[0]

    def sleep(dt):
        slept.append(dt)
        now[0] += dt

    late = start.wait_until(10.0, clock, sleep, spin=0.002)
    assert slept == [pytest.approx(0.998 - 1e-6, abs=1e-9)]  # until 2 ms before, then spinning
    assert 0 <= late <= 2e-6 and now[0] >= 10.0
    slept.clear()
    assert start.wait_until(9.5, clock, sleep) == pytest.approx(now[0] - 9.5, abs=1e-9) and not slept  # past

    def oversleep(dt):
        now[0] += dt + 0.005

    now[0] = 9.0
    assert start.wait_until(10.0, clock, oversleep, spin=0.002) == pytest.approx(0.003, abs=1e-5)


def test_margin_rule():
    # first: 4 round trips per hop of a binomial broadcast (ceil(log2 P) hops)
    assert start.first_margin(0.05, 2) == pytest.approx(0.2)
    assert start.first_margin(0.05, 4) == pytest.approx(0.4)
    assert start.first_margin(0.05, 5) == pytest.approx(0.6)
    assert start.first_margin(0.0, 4) == start.MIN_MARGIN_S
    # then twice the worst lag so far, at least MIN_MARGIN_S; unchanged until a lag is known
    assert start.next_margin(0.4, 0.0, first=True) == 0.4
    assert start.next_margin(0.4, 0.06, first=False) == pytest.approx(0.12)
    assert start.next_margin(0.4, 1e-5, first=False) == start.MIN_MARGIN_S


# -- the start rule ------------------------------------------------------------------------------

def _samples(mode: str, ends, offsets=(0.0, 5.0, -3.0), n=3, oversleep=0.0):
    """Each rank of a 10 ms fake network ends its last sample at true time ``ends[r]``, then starts n
    samples (none takes time); per rank: [(true start, local start, lateness, margin)] per sample."""
    net = FakeNet(len(ends), list(offsets), lambda s, d, k: 0.010, oversleep=oversleep)

    def rank(r, d):
        st = start.Starter(mode, d, r, net.P, clock=d.clock, sleep=d.sleep)
        st.sync()
        net.t[r] = ends[r]
        out = []
        for _ in range(n):
            local = st.begin()
            out.append((net.t[r], local, st.late, st.margin, st.actual_start()))
        return out

    return run_ranks(net, rank)


def test_window_starts_every_rank_at_one_true_instant():
    got = _samples("window", ends=[100.0, 100.02, 100.05])
    offsets = (0.0, 5.0, -3.0)
    for i in range(3):
        true = [got[r][i][0] for r in range(3)]
        assert max(true) - min(true) < 1e-4  # one instant (clock reads of a µs each aside)
        for r in range(3):
            _, local, late, _, actual = got[r][i]
            assert late < 1e-4  # nobody learned the start after it
            assert local - offsets[r] == pytest.approx(got[0][i][1], abs=1e-9)  # the same instant, read on rank 0's clock
            assert actual == pytest.approx(got[0][i][1], abs=1e-4)
    # the first margin: 4 sync round trips (20 ms) per hop, 2 hops at P = 3; after a sample, twice the
    # worst lag: a rank learns the start 10 ms (the broadcast) after rank 0 fixed it
    assert got[0][0][3] == pytest.approx(0.16, abs=1e-4)  # (the round trips hold clock reads of a µs)
    assert got[0][1][3] == pytest.approx(0.020, abs=1e-4) and got[1][2][3] == got[0][2][3]
    # the first start comes a margin after rank 0 knew every rank had ended (the last at 100.05, 10 ms away)
    assert got[0][0][0] == pytest.approx(100.05 + 0.010 + 0.16, abs=1e-4)


def test_window_counts_a_late_wake_up_as_late():
    got = _samples("window", ends=[100.0, 100.0, 100.0], oversleep=0.004)  # every sleep 4 ms too long
    lates = [got[r][i][2] for r in range(3) for i in range(3)]
    assert all(x == pytest.approx(0.004 - start.SPIN_S, abs=1e-4) for x in lates if x > 0)
    recs = start.summary("window", [[s[4] for s in got[r]] for r in range(3)], [[s[2] for s in got[r]] for r in range(3)])
    assert recs["late_samples"] == 3 and recs["late_us_max"] == pytest.approx(2000, abs=100)


def test_barrier_start_keeps_the_barriers_exit_skew():
    """The old method: each rank times from its own exit of the barrier; rank 0 (the fake barrier's
    root) leaves it 10 ms before the others, which the records' start skew shows."""
    got = _samples("barrier", ends=[100.0, 100.02, 100.05])
    for i in range(3):
        assert got[1][i][0] - got[0][i][0] == pytest.approx(0.010, abs=1e-4)
        assert got[2][i][0] == pytest.approx(got[1][i][0], abs=1e-4)
    s = start.summary("barrier", [[x[4] for x in got[r]] for r in range(3)], [[x[2] for x in got[r]] for r in range(3)])
    assert s["mode"] == "barrier" and s["late_samples"] == 0
    assert s["skew_us_median"] == pytest.approx(10000, abs=100) and s["skew_us_max"] == pytest.approx(10000, abs=100)


def test_summary_statistics():
    s = start.summary("window", [[0.0, 1.0, 2.0, 3.0], [0.001, 1.0, 2.004, 3.002]],
                      [[0.0, 0.0, 0.0, 0.0], [0.001, 0.0, 0.004, 0.0005]])
    assert s["skew_us_median"] == pytest.approx(1500) and s["skew_us_max"] == pytest.approx(4000)
    assert s["late_samples"] == 1 and s["late_us_max"] == pytest.approx(4000)  # over LATE_S: the 4 ms one only
    with pytest.raises(ValueError):
        start.Starter("now", None, 0, 1)


# -- over Gloo -----------------------------------------------------------------------------------

def _offset_on_gloo(rank: int, shift: float):
    import time

    import torch.distributed as dist

    return start.estimate_offset(dist, rank, dist.get_world_size(),
                                 clock=lambda: time.perf_counter() + (shift if rank == 1 else 0.0))


@pytest.mark.timeout(120)
def test_offset_over_gloo_finds_a_shifted_clock():
    """Two spawned ranks on this host's one clock, rank 1's read 7 s ahead: the estimate is -7 s to within
    its round trip (loopback: well under a millisecond on an idle host; 5 ms allowed for a loaded one)."""
    import distrain

    res = distrain.spawn(_offset_on_gloo, 2, args=(7.0,), timeout=90)
    offset, rtt = res[1]
    assert res[0] == (0.0, 0.0) and 0 < rtt < 0.05
    assert abs(offset + 7.0) <= max(rtt / 2, 1e-6) + 1e-3
    assert math.isfinite(offset)
