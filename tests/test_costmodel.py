"""The cost model: schedules carry exactly the ledger's bytes; times match the closed forms."""

from __future__ import annotations

import json
import math

import pytest

from distrain.bench.link import calibrate as link_bench
from distrain.comm.algorithms.cost import traffic
from distrain.costmodel import Fabric, Link, Message, predict, predict_ps, simulate
from distrain.costmodel.links import calibrated_fabric
from distrain.errors import ConfigError

B = 1e8  # bytes/s


def _fabric(P: int, alpha: float = 0.0, gamma: float = 0.0, per_node: int = 1) -> Fabric:
    return Fabric(tuple(r // per_node for r in range(P)), Link(alpha, B), Link(alpha, 10 * B), gamma)


@pytest.mark.parametrize("P", [2, 3, 5, 8])
@pytest.mark.parametrize("alg,colls", [("star", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"]),
                                       ("ring", ["all_reduce", "all_gather", "reduce_scatter"]),
                                       ("tree", ["all_reduce", "broadcast", "reduce"])])
def test_schedule_bytes_equal_the_traffic_formulas(P, alg, colls):
    # 1000003 elements: not divisible by any P; every rank's uplink carries what it sends
    f = _fabric(P)
    for coll in colls:
        per_rank = coll in ("all_gather", "reduce_scatter")
        count = 1000003 // (P if per_rank else 1)
        size = count * 4 * (P if per_rank else 1)
        res = predict(coll, alg, size, f)
        for r in range(P):
            sent, recv = traffic(coll, alg, P, r, count, 4)
            assert res.link_bytes.get(("up", r), 0) == sent, (coll, alg, P, r)
            assert res.link_bytes.get(("down", r), 0) == recv, (coll, alg, P, r)


@pytest.mark.parametrize("P", [2, 3, 4, 7])
def test_bandwidth_terms_match_the_seeds(P):
    N = 64 << 20
    f = _fabric(P)
    # star: the root's link carries (P-1)N each way, one direction after the other
    assert predict("all_reduce", "star", N, f).seconds == pytest.approx(2 * (P - 1) * N / B, rel=1e-9)
    # ring: 2(P-1) steps of N/P, pieces pipelined along the ring (Patarasuk & Yuan)
    assert predict("all_reduce", "ring", N, f).seconds == pytest.approx(2 * (P - 1) / P * N / B, rel=1e-3)
    # broadcast from a star root: P-1 copies share its uplink
    assert predict("broadcast", "star", N, f).seconds == pytest.approx((P - 1) * N / B, rel=1e-9)


def test_tree_shares_the_root_link_and_waits_for_subtrees():
    N = 1 << 20
    f = _fabric(4)
    # reduce: position 1 -> 0 at once; 3 -> 2 then 2 -> 0: the root's downlink serves 1 then 2 -> 2N/B
    assert predict("reduce", "tree", N, f).seconds == pytest.approx(2 * N / B)
    # broadcast: 0 -> {2, 1} share the uplink (2N/B), then 2 -> 3 (N/B)
    assert predict("broadcast", "tree", N, f).seconds == pytest.approx(3 * N / B)


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_latency_terms(P):
    a = 1e-3
    f = _fabric(P, alpha=a)
    tiny = 4  # bytes: the α terms dominate
    assert predict("all_reduce", "star", tiny, f).seconds == pytest.approx(2 * a, rel=1e-3)
    # the root posts its ceil(log2 P) sends at once, so the α's add up along the deepest path only:
    # depth = the most 1-bits of a position v < P (v's path to the root clears one bit per hop)
    depth = max(bin(v).count("1") for v in range(P))
    assert depth <= math.ceil(math.log2(P))
    assert predict("all_reduce", "tree", tiny, f).seconds == pytest.approx(2 * depth * a, rel=1e-3)
    if P > 2:  # with 4 bytes and P > 4 some chunks are empty but still one message each
        assert predict("all_reduce", "ring", 4 * P, f).seconds == pytest.approx(2 * (P - 1) * a, rel=1e-3)


def test_reduction_compute_and_intra_node_links():
    g = 1e-9
    f = _fabric(3, gamma=g)
    N = 1 << 20
    # star: the root adds 2 contributions before it broadcasts
    assert predict("all_reduce", "star", N, f).seconds == pytest.approx(4 * N / B + 2 * g * N)
    # two ranks per node: rank 0 and 1 talk over the node's 10x faster shared link
    f2 = _fabric(4, per_node=2)
    assert predict("broadcast", "star", N, f2).seconds == pytest.approx(2 * N / B)  # 2 copies up node 0's link
    assert f2.path(0, 1) == (("intra", 0),) and f2.path(1, 2) == (("up", 0), ("down", 1))


def test_parameter_server_round():
    N = 8 << 20
    for S in (1, 2):
        f = _fabric(6)
        W = 6 - S
        res = predict_ps(N, S, f)
        # every server's link carries W shards of N/S each way: pull (fan-out) then push (fan-in)
        for s in range(S):
            assert res.link_bytes[("up", W + s)] == res.link_bytes[("down", W + s)] == pytest.approx(W * N / S)
        assert res.seconds == pytest.approx(2 * W * N / S / B, rel=1e-9)


def test_simulator_checks_its_input():
    f = _fabric(2)
    with pytest.raises(ValueError, match="dependency 1 must be an earlier message"):
        simulate([Message(0, 1, 10, deps=(1,)), Message(1, 0, 10)], f)
    bad = Fabric((0, 1), Link(0.0, 0.0), Link(0.0, 1.0))
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        simulate([Message(0, 1, 10)], bad)
    assert predict("all_reduce", "native", 1 << 20, f) is None
    assert predict("scatter", "ring", 1 << 20, f) is None


def test_link_fit_and_calibration_file(tmp_path):
    sizes = [8, 256 << 10, 1 << 20, 4 << 20]
    alpha, beta = 50e-6, 1 / 25e6
    a, b = link_bench.fit(sizes, [alpha + n * beta for n in sizes])
    assert a == pytest.approx(alpha) and b == pytest.approx(beta)
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"model": {"inter": {"alpha_us": 50, "bandwidth_GBps": 0.025},
                                          "intra": {"alpha_us": 20, "bandwidth_GBps": 1.5},
                                          "gamma_ns_per_byte": 0.25}}))
    f = calibrated_fabric(str(path), [0, 0, 1])
    assert f.inter.alpha == pytest.approx(50e-6) and f.inter.bandwidth == pytest.approx(25e6)
    assert f.intra.bandwidth == pytest.approx(1.5e9) and f.gamma == pytest.approx(0.25e-9)
    with pytest.raises(ConfigError, match="write one with `distrain bench link --json"):
        calibrated_fabric(str(tmp_path / "missing.json"), [0, 1])


def test_a_host_bound_shift_makes_a_shared_host_capacity():
    """All links busy at once (a ring) share the emulating host; one busy link (a star's root) does not."""
    from distrain.costmodel.links import fabric_from_model

    P, n = 4, 4 << 20
    cal = {"inter": {"alpha_us": 0, "bandwidth_GBps": B / 1e9}, "gamma_ns_per_byte": 0}

    def fabric(per_link: float) -> Fabric:  # a calibration whose shift gave each link per_link bytes/s
        shift = {"per_link_GBps": per_link / 1e9, "aggregate_GBps": P * per_link / 1e9}
        return fabric_from_model(dict(cal, shift=shift), list(range(P)))

    bound, free = fabric(0.5 * B), fabric(0.95 * B)
    assert bound.host == pytest.approx(2 * B) and free.host is None  # under HOST_BOUND = 0.9: host-bound
    ring, ring_free = predict("all_reduce", "ring", n, bound), predict("all_reduce", "ring", n, free)
    # every ring step has P = 4 flows at once: each gets host / 4 = B / 2, so the ring takes twice as long
    assert ring.seconds == pytest.approx(2 * ring_free.seconds)
    assert ring.link_bytes == ring_free.link_bytes  # the host is a capacity, not a link with bytes of its own
    # a star's root sends its 3 pieces on its one uplink (B in all, under the host's 2·B): no slower
    star, star_free = predict("broadcast", "star", n, bound), predict("broadcast", "star", n, free)
    assert star.seconds == pytest.approx(star_free.seconds)


def test_plan_ranks_strategies_with_the_seeds_link_loads():
    from distrain.costmodel import plan

    m = plan.model_spec("gpt-small", None)
    assert (m.params, m.layers, m.hidden, m.heads, m.seq) == (867072, 4, 128, 4, 64)
    P, N = 4, 4 * m.params
    fabric = plan.Fabric(plan.block_placement(P, 1), plan.LINKS["eth-1g"], plan.INTRA["shm"], 0.0)
    rows = {r.strategy: r for r in plan.plans(m, fabric, 0.1, 32, 1, 8)}
    assert rows["ddp star"].busiest_bytes == (P - 1) * N  # the root's link (seeds: (P-1)N)
    assert rows["ddp ring"].busiest_bytes == pytest.approx(2 * (P - 1) / P * N, rel=1e-6)
    assert rows["ps-sync S=1"].busiest_bytes == (P - 1) * N  # the server's link, each way
    assert rows["ddp ring"].step_s < rows["ddp tree"].step_s < rows["ddp star"].step_s
    assert rows["ddp ring"].compute_s == pytest.approx(0.1 / P)
    assert rows["ps-sync S=1"].compute_s == pytest.approx(0.1 / (P - 1))
    # 16 bytes per parameter held (weights, grads, AdamW moments); tp x pp = 4 holds a quarter
    assert rows["dp2 x tp1 x pp2 (ring)"].mem_bytes < rows["ddp ring"].mem_bytes
    assert rows["ddp ring"].mem_bytes > 16 * m.params


def test_plan_command(capsys):
    from distrain.cli import main

    assert main(["plan", "--model", "gpt-small", "--nodes", "2", "--procs-per-node", "2", "--link", "eth-10g",
                 "--compute-ms", "100"]) == 0
    out = capsys.readouterr().out
    assert "867,072 parameters" in out and "ddp ring" in out and "dp1 x tp2 x pp2 (ring)" in out
    assert main(["plan", "--nodes", "2", "--link", "eth-7g", "--compute-ms", "1"]) == 2
    assert "--link must be one of eth-100m, eth-1g" in capsys.readouterr().err
    assert main(["plan", "--params", "1000", "--nodes", "2"]) == 2
    assert "--params needs --compute-ms" in capsys.readouterr().err


def test_prediction_table_from_bench_json(tmp_path):
    from distrain.bench.comm import predict as comm_predict

    recs = [{"P": 2, "op": "all_reduce", "algorithm": "ring", "size_bytes": 1 << 20, "time_us": 100000.0,
             "predicted_us": 90000.0, "predicted_error_pct": -10.0},
            {"P": 2, "op": "all_reduce", "algorithm": "native", "size_bytes": 1 << 20, "time_us": 80000.0,
             "predicted_us": None, "predicted_error_pct": None}]
    path = tmp_path / "comm_100mbit_2.json"
    path.write_text(json.dumps({"meta": {}, "records": recs}))
    md = comm_predict.markdown(comm_predict.load([str(path)]))
    assert "| 100mbit | 2 | ring | 100.0 / 90.0 (-10%) |" in md
    assert "| 100mbit | 2 | native | 80.0 / - |" in md
    f = _fabric(2)
    comm_predict.annotate(recs, f, 4)
    assert recs[0]["predicted_us"] == pytest.approx((1 << 20) / B * 1e6, rel=1e-3)  # 2 steps of N/2 each way
    assert recs[1]["predicted_us"] is None and recs[0]["placement"] == [0, 1]


def _ddp_bucket_sizes(rank: int, name: str) -> list[int]:
    from distrain.models import build_model
    from distrain.parallel import DistributedDataParallel

    return DistributedDataParallel(build_model(name)).bucket_sizes


@pytest.mark.timeout(120)
def test_plan_buckets_are_those_ddp_builds():
    import distrain
    from distrain.costmodel import plan

    for name in ("mlp", "gpt-small"):
        assert plan.ddp_buckets(plan.model_spec(name, None)) == distrain.spawn(_ddp_bucket_sizes, 1, args=(name,),
                                                                                 timeout=100)[0]
    # --params: 1 MiB tensors, so a 1 MiB first bucket, then 25 MiB ones
    assert plan.ddp_buckets(plan.ModelSpec("n", 15 << 20)) == [1 << 20, 25 << 20, 25 << 20, 9 << 20]


def test_plan_ddp_overlaps_buckets_with_backward():
    from distrain.costmodel import plan

    # two buckets of 1 MiB and 3 MiB (parameters of 3 MiB and 1 MiB, reversed); P = 2 ring, α = γ = 0:
    # each all-reduce takes b / B (2 steps of b/2); fb = 0.09 s, backward the last 0.06 s
    m = plan.ModelSpec("two", 1 << 20, param_bytes=(3 << 20, 1 << 20))
    c = plan.Compute(lambda b: 0.09, opt=1e-8)
    f = _fabric(2)
    row = plan.plan_ddp(m, f, c, 32, "ring")
    first_ready, second_ready = 0.03 + 0.06 * 0.25, 0.09
    t1, t2 = (1 << 20) / B, (3 << 20) / B
    end = max(first_ready + t1, second_ready) + t2
    assert row.step_s == pytest.approx(0.09 + 1e-8 * (1 << 20) + end - 0.09, rel=1e-9)
    assert row.comm_s == pytest.approx(t1 + t2, rel=1e-9)
    # the PS tail: W adds (γ each) and the optimizer over the shard
    ps = plan.plan_ps(m, _fabric(3, gamma=1e-10), c, 32, 1)
    assert ps.comm_s == pytest.approx(2 * 2 * (4 << 20) / B + 1e-10 * (4 << 20) * 2 + 1e-8 * (1 << 20), rel=1e-9)


def test_bench_ps_records_beside_predict_ps(tmp_path, capsys):
    from distrain.cli import main
    from distrain.costmodel.links import calibrated_fabric

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": {"intra": {"alpha_us": 30, "bandwidth_GBps": 1.0}, "gamma_ns_per_byte": 0.2}}))
    out = tmp_path / "ps.json"
    assert main(["bench", "ps", "--nproc", "3", "--servers", "1,2", "--sizes", "64K,96K", "--warmup", "0",
                 "--iters", "2", "--predict", str(cal), "--json", str(out)]) == 0
    recs = json.loads(out.read_text())["records"]
    assert [(r["P"], r["S"], r["W"], r["size_bytes"], r["algorithm"]) for r in recs] == [
        (3, 1, 2, 64 << 10, "ps S=1"), (3, 1, 2, 96 << 10, "ps S=1"),
        (3, 2, 1, 64 << 10, "ps S=2"), (3, 2, 1, 96 << 10, "ps S=2")]
    f = calibrated_fabric(str(cal), [0, 0, 0])
    for r in recs:
        assert len(r["times_us"]) == 2 and r["time_us"] > 0
        assert r["predicted_us"] == pytest.approx(predict_ps(r["size_bytes"], r["S"], f).seconds * 1e6, rel=1e-12)
        assert r["predicted_error_pct"] == pytest.approx(100 * (r["predicted_us"] - r["time_us"]) / r["time_us"])
    assert main(["bench", "ps", "--nproc", "2", "--servers", "2"]) == 2
    assert "--servers: 2 servers need at least 3 processes (S servers + at least 1 worker); this run has 2" in \
        capsys.readouterr().err
    assert main(["bench", "ps", "--nproc", "3", "--servers", "2", "--sizes", "100"]) == 2
    assert "--sizes: 100 bytes is not 8 equal float32 tensors; give a multiple of 32 bytes" in capsys.readouterr().err


def test_step_prediction_row_from_a_run_folder(tmp_path):
    from distrain.bench.train import step_predict
    from distrain.costmodel import plan
    from distrain.costmodel.links import calibrated_fabric

    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"model": {"inter": {"alpha_us": 100, "bandwidth_GBps": 0.0125},
                                         "gamma_ns_per_byte": 0.5}}))
    run = tmp_path / "run"
    run.mkdir()
    seen = []

    def fixed(model, ranks, local_batch, threads):
        seen.append((model, ranks, local_batch))
        return plan.Compute(lambda b: 0.2, 1e-8)

    for strategy, ranks, local in (("ddp", 4, 8.0), ("ps-sync", 3, 32 / 3)):
        (run / "config.json").write_text(json.dumps({"model": "mlp-tiny", "strategy": strategy, "nproc": 4,
                                                     "servers": 1, "batch_size": 32, "algorithm": "ring"}))
        # the first two steps (start-up) are left out: median of 0.5, 0.7, 0.6 = 0.6 s
        (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "time_s": t}) + "\n"
                                                   for i, t in enumerate([9.0, 2.0, 0.5, 0.7, 0.6])))
        row = step_predict.row(str(cal), "100mbit", run, compute=fixed)
        f = calibrated_fabric(str(cal), [0, 1, 2, 3])
        spec, c = plan.model_spec("mlp-tiny", None), plan.Compute(lambda b: 0.2, 1e-8)
        want = (plan.plan_ddp(spec, f, c, 32, "ring") if strategy == "ddp" else plan.plan_ps(spec, f, c, 32, 1)).step_s
        assert row[:6] == ["mlp-tiny", "ddp ring" if strategy == "ddp" else "ps-sync S=1", "100mbit", "4", "600",
                           f"{want * 1e3:.0f}"]
        assert row[7] == f"{100 * (want - 0.6) / 0.6:+.0f}%"
        assert seen[-1] == ("mlp-tiny", ranks, pytest.approx(local))


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_handshake_adds_one_notice_per_call(P):
    """Gloo's TCP pair sends once the receiver's "receive ready" notice has arrived: a call's first
    messages wait α(dst, src) more; every later receive is posted before its sender is ready."""
    from dataclasses import replace

    from distrain.costmodel.collectives import ring_time

    a = 1e-3
    f = replace(_fabric(P, alpha=a), handshake=True)
    depth = max(bin(v).count("1") for v in range(P))
    assert predict("all_reduce", "star", 4, f).seconds == pytest.approx(3 * a, rel=1e-3)
    assert predict("all_reduce", "tree", 4, f).seconds == pytest.approx((2 * depth + 1) * a, rel=1e-3)
    assert predict("reduce_scatter", "ring", 4 * P * P, f).seconds == pytest.approx(P * a, rel=1e-3)
    if P > 2:
        assert predict("all_reduce", "ring", 4 * P, f).seconds == pytest.approx((2 * (P - 1) + 1) * a, rel=1e-3)
    # the closed form (distrain plan's ring): the seeds' 2(P-1)(α + N/(P·B)) plus the one notice
    N = P * (1 << 20)
    seconds, _ = ring_time(f, [list(range(P))], N)
    assert seconds == pytest.approx(2 * (P - 1) * (a + N / P / B) + a, rel=1e-12)
    assert predict("all_reduce", "ring", N, f).seconds == pytest.approx(seconds, rel=1e-9)
    assert ring_time(replace(f, handshake=False), [list(range(P))], N)[0] == pytest.approx(seconds - a, rel=1e-12)


def test_a_calibration_says_whether_its_transport_has_the_handshake():
    """bench link over torch's transport writes "handshake": true in its links; its shift's rate leaves out the
    shift's latency (the notice's α and the message's own), so 25 ms links are not taken as host-bound."""
    from distrain.bench.link.calibrate import shift_rates
    from distrain.costmodel.links import fabric_from_model

    alpha, n, P = 25e-3, 4 << 20, 2
    shift = {"bytes": n, "time_us": (2 * alpha + n / B) * 1e6}
    shift_rates(shift, P, 2 * alpha * 1e6)
    assert shift["per_link_bytes_GBps"] == pytest.approx(B / 1e9, rel=1e-12)
    assert shift["aggregate_bytes_GBps"] == pytest.approx(P * B / 1e9, rel=1e-12)
    # the whole time's rate stays what the links carried, latency included
    assert shift["per_link_GBps"] == pytest.approx(n / (2 * alpha + n / B) / 1e9, rel=1e-12)
    assert shift["aggregate_GBps"] == pytest.approx(P * shift["per_link_GBps"], rel=1e-12)
    assert shift["latency_us"] == pytest.approx(2 * alpha * 1e6)
    link = {"alpha_us": alpha * 1e6, "bandwidth_GBps": B / 1e9}
    cal = {"inter": link, "gamma_ns_per_byte": 0, "shift": shift}
    f = fabric_from_model(dict(cal, inter=dict(link, handshake=True)), [0, 1])
    assert f.handshake is True and f.host is None
    assert fabric_from_model(cal, [0, 1]).handshake is False  # a calibration from before the field
    # the same shift's time read whole (the old rate: n / time) was 0.72 of B: host-bound, a host of 1.44·B
    old = {"bytes": n, "time_us": shift["time_us"], "per_link_GBps": n / (shift["time_us"] * 1e-6) / 1e9,
           "aggregate_GBps": P * n / (shift["time_us"] * 1e-6) / 1e9}
    assert fabric_from_model(dict(cal, shift=old), [0, 1]).host == pytest.approx(P * n / (2 * alpha + n / B))
