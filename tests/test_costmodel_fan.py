"""The fan term of the cost model: bench link's fan-in/fan-out efficiencies (TCP incast) and their use."""

from __future__ import annotations

import json
import os

import pytest

from distrain.bench.comm.predict import annotate
from distrain.bench.link.fan import efficiencies
from distrain.costmodel import Fabric, Link, predict
from distrain.costmodel.collectives import ring_time
from distrain.costmodel.links import fabric_from_model
from distrain.errors import ConfigError

B, N = 1e7, 4 << 20  # bytes/s; bytes per flow
DATA = os.path.join(os.path.dirname(__file__), "..", "docs", "cost_model_data", "delay25ms", "window")


def _fan(latency: float, rate_in: list[list[float]], rate_out: list[list[float]], sizes=(N,)) -> dict:
    """A fan record whose k flows of n bytes took latency + k·n / rate[size][k-1] seconds."""
    def times(rates):
        return [[(latency + k * n / r) * 1e6 for k, r in zip((1, 2, 3), row)] for n, row in zip(sizes, rates)]
    return {"bytes": list(sizes), "senders": [1, 2, 3], "in_time_us": times(rate_in), "out_time_us": times(rate_out)}


def test_efficiencies_are_goodput_over_the_ping_pongs_rate_without_the_latency():
    fan = _fan(0.05, [[B, 0.8 * B, 0.5 * B]], [[0.9 * B, B, 1.2 * B]])
    efficiencies(fan, 0.05e6, B / 1e9)
    assert fan["latency_us"] == 0.05e6 and fan["bandwidth_GBps"] == B / 1e9
    assert fan["in_goodput_GBps"] == [pytest.approx([B / 1e9, 0.8 * B / 1e9, 0.5 * B / 1e9], rel=1e-12)]
    assert fan["in_efficiency"] == [pytest.approx([1.0, 0.8, 0.5], rel=1e-12)]
    assert fan["out_efficiency"] == [pytest.approx([0.9, 1.0, 1.0], rel=1e-12)]  # above the ping-pong: capped at 1


def _fabric(**kw) -> Fabric:
    return Fabric((0, 1, 2, 3), Link(0.0, B), Link(0.0, 10 * B), 0.0, **kw)


def test_a_link_with_k_flows_of_n_bytes_delivers_its_rate_times_e_k_n():
    # two sizes, 1 and 4 MiB: e at 2 MiB is halfway between them (log n)
    f = _fabric(fan_sizes=(1 << 20, 4 << 20), fan_in=((1.0, 0.9, 0.7), (0.8, 0.6, 0.5)), fan_out=((1.0, 0.9),) * 2)
    assert f.bandwidth(("down", 0)) == B and f.bandwidth(("down", 0), 3) == B  # length not known: the link's rate
    assert f.bandwidth(("down", 0), 1, 4 << 20) == pytest.approx(0.8 * B)  # one long flow
    assert f.bandwidth(("down", 0), 2, 1 << 20) == pytest.approx(0.9 * B)
    assert f.bandwidth(("down", 0), 3, 2 << 20) == pytest.approx(0.6 * B)  # (0.7 + 0.5) / 2
    assert f.bandwidth(("down", 0), 7, 64 << 20) == pytest.approx(0.5 * B)  # past the measured k and n: the last
    assert f.bandwidth(("down", 0), 2, 1000) == pytest.approx(0.9 * B)  # below the smallest size: its row
    assert f.bandwidth(("up", 0), 3, 1 << 20) == pytest.approx(0.9 * B)
    assert f.bandwidth(("intra", 0), 3, 1 << 20) == 10 * B  # a node's loopback is not the emulator's TCP queue


def test_star_all_reduce_pays_the_fan_on_the_roots_links_and_a_ring_its_long_flow():
    # P = 4, α = γ = 0, one size: the reduce's 3 flows share node 0's downlink at 0.5·B in all, the broadcast's
    # 3 its uplink at 0.9·B: 3N/(0.5B) + 3N/(0.9B), where the lossless link gives 2·3N/B
    f = _fabric(fan_sizes=(N,), fan_in=((1.0, 0.8, 0.5),), fan_out=((1.0, 0.9, 0.9),))
    assert predict("all_reduce", "star", N, f).seconds == pytest.approx(3 * N / (0.5 * B) + 3 * N / (0.9 * B), rel=1e-9)
    plain = _fabric()
    assert predict("all_reduce", "star", N, plain).seconds == pytest.approx(6 * N / B, rel=1e-9)
    # a ring puts one flow on each link, whose connection carries 2(P-1)/P·N: at e(1) = 1 nothing changes,
    # in the simulator and the closed form
    ring = predict("all_reduce", "ring", N, plain).seconds
    assert predict("all_reduce", "ring", N, f).seconds == pytest.approx(ring, rel=1e-12)
    assert ring_time(f, [[0, 1, 2, 3]], N) == ring_time(plain, [[0, 1, 2, 3]], N)
    # a long single flow at 0.8 of the rate: every hop's bytes take 1/0.8 as long (α = γ = 0: all bytes)
    slow = _fabric(fan_sizes=(N,), fan_in=((0.8, 0.8, 0.8),), fan_out=((1.0, 1.0, 1.0),))
    assert predict("all_reduce", "ring", N, slow).seconds == pytest.approx(ring / 0.8, rel=1e-9)
    assert ring_time(slow, [[0, 1, 2, 3]], N)[0] == pytest.approx(ring_time(plain, [[0, 1, 2, 3]], N)[0] / 0.8, rel=1e-9)


def test_a_calibration_with_a_fan_gives_the_fabric_its_efficiencies():
    link = {"alpha_us": 0.0, "bandwidth_GBps": B / 1e9, "handshake": True}
    # sizes written in any order: the fabric's ascend
    fan = _fan(0.0, [[B, 0.8 * B, 0.5 * B], [B, B, B]], [[B, 0.9 * B, 0.9 * B]] * 2, sizes=(N, N // 4))
    efficiencies(fan, 0.0, B / 1e9)
    f = fabric_from_model({"inter": link, "gamma_ns_per_byte": 0, "fan": fan}, [0, 1, 2, 3])
    assert f.fan_sizes == (N // 4, N)
    assert f.fan_in == (pytest.approx((1.0, 1.0, 1.0)), pytest.approx((1.0, 0.8, 0.5)))
    assert f.fan_out == (pytest.approx((1.0, 0.9, 0.9)),) * 2
    assert fabric_from_model({"inter": link, "gamma_ns_per_byte": 0}, [0, 1]).fan_in == ()  # none: as before
    with pytest.raises(ConfigError, match="in_efficiency"):
        fabric_from_model({"inter": link, "fan": dict(fan, in_efficiency=[[1.0, 0.0], [1.0]])}, [0, 1])
    with pytest.raises(ConfigError, match="fan bytes"):
        fabric_from_model({"inter": link, "fan": dict(fan, bytes=N)}, [0, 1])


def test_an_old_calibration_without_a_fan_predicts_what_it_predicted():
    """The P = 4 calibration of 2026-12-01 (no fan) re-predicts every stored record of its run exactly."""
    with open(os.path.join(DATA, "link_100mbit_4.json")) as f:
        model = json.load(f)["model"]
    assert "fan" not in model
    with open(os.path.join(DATA, "comm_100mbit_4_window.json")) as f:
        recs = [r for r in json.load(f)["records"] if r.get("predicted_us") is not None]
    assert len(recs) == 9
    fabric = fabric_from_model(model, [0, 1, 2, 3])
    for r in recs:
        old = r["predicted_us"]
        annotate([r], fabric, 4)
        assert r["predicted_us"] == pytest.approx(old, rel=1e-9), (r["algorithm"], r["size_bytes"])


def test_one_flow_no_longer_than_the_ping_pongs_keeps_the_fitted_rate():
    """k = 1 up to the ping-pong's largest size (the shift's bytes) is the flow β was fitted on: e = 1 there;
    a longer single flow (one that may overshoot the queue) and every k >= 2 keep the fan's value."""
    link = {"alpha_us": 0.0, "bandwidth_GBps": B / 1e9}
    fan = _fan(0.0, [[0.3 * B, 0.9 * B, 0.8 * B], [0.7 * B, 0.6 * B, 0.5 * B]], [[0.4 * B, B, B]] * 2,
               sizes=(N, 4 * N))
    efficiencies(fan, 0.0, B / 1e9)
    shift = {"bytes": N, "per_link_GBps": B / 1e9, "aggregate_GBps": 4 * B / 1e9}  # no host limit
    f = fabric_from_model({"inter": link, "shift": shift, "fan": fan}, [0, 1, 2, 3])
    assert f.host is None
    assert f.fan_in == (pytest.approx((1.0, 0.9, 0.8)), pytest.approx((0.7, 0.6, 0.5)))
    assert f.fan_out == (pytest.approx((1.0, 1.0, 1.0)), pytest.approx((0.4, 1.0, 1.0)))
