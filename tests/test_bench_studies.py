"""The studies behind the documents' tables, as ``distrain bench`` subcommands (cli/bench_studies.py):
their flags reach the typed ``run`` of each study, and bad input is one line before any work."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from distrain.bench.comm import predict
from distrain.cli import main
from distrain.cluster.fixture import emulated_cluster  # noqa: F401  (the fixture)

ROOT = Path(__file__).resolve().parents[1]
COMM_RECORDS = sorted(glob.glob(str(ROOT / "docs/cost_model_data/comm_*.json")))


def test_bench_predict_writes_the_table_of_its_records(tmp_path):
    table, plot = tmp_path / "t.md", tmp_path / "p.png"
    assert main(["bench", "predict", "--table", str(table), "--plot", str(plot), "--size", "4M", *COMM_RECORDS]) == 0
    assert table.read_text() == predict.markdown(predict.load(COMM_RECORDS)) + "\n"
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, line", [
    (["bench", "predict", "x.json"],
     "distrain: error: bench predict: give --table OUT.md and --plot OUT.png (or --repredict LINK.json)"),
    (["bench", "predict", "--repredict", "l.json", "--table", "t.md", "x.json"],
     "distrain: error: bench predict: --repredict rewrites the records; give --table/--plot in another run"),
    (["bench", "step-predict", "nowhere.json", "100mbit", "run"],
     "distrain: error: bench step-predict: no calibration file nowhere.json; write one with distrain bench link "
     "--json"),
    (["bench", "cp-memory", "--cp", "1"], "distrain: error: --cp: values must be >= 2, got 1"),
    (["bench", "activation-memory", "--layers", "0"], "distrain: error: --layers: must be >= 1, got 0"),
])
def test_bad_input_is_one_line(argv, line, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line


def test_step_predict_names_a_folder_that_is_not_a_run(tmp_path, capsys):
    cal = ROOT / "docs/cost_model_data/link_100mbit_2.json"
    assert main(["bench", "step-predict", str(cal), "100mbit", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"distrain: error: bench step-predict: {tmp_path} is not a distrain "
                                               f"train run folder (no config.json); give folders written by "
                                               f"distrain train --out")


@pytest.mark.slow
def test_activation_memory_checkpointing_keeps_less_for_backward(tmp_path):
    out = tmp_path / "a.json"
    assert main(["bench", "activation-memory", "--model", "gpt-tiny", "--layers", "2", "--batch", "2", "--reps", "1",
                 "--json", str(out)]) == 0
    off, on = json.loads(out.read_text())["rows"]
    assert (off["checkpointing"], on["checkpointing"]) == (False, True)
    assert 0 < on["saved_mib"] < off["saved_mib"]


@pytest.mark.slow
def test_cp_memory_counts_the_formulas_bytes(tmp_path):
    out = tmp_path / "c.json"
    assert main(["bench", "cp-memory", "--model", "gpt-tiny", "--seq", "64", "--cp", "2", "--reps", "1",
                 "--json", str(out)]) == 0
    one, ring, a2a = json.loads(out.read_text())["rows"]
    assert one["cp"] == 1 and one["cp_bytes_sent_max"] == 0
    for row in (ring, a2a):
        assert row["cp"] == 2 and row["cp_bytes_sent_max"] == row["formula_bytes"] > 0
        assert row["saved_bytes_max"] < one["saved_bytes_max"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_comm_predict_across_the_emulated_cluster_puts_the_prediction_beside_the_measurement(
        emulated_cluster, tmp_path):
    """``distrain bench comm --predict`` with no file (docs/cost_model.md): the links calibrated on the
    spot across two nodes, then star against ring with the cost model's time beside each measured one."""
    from distrain.cluster import runner

    spec = emulated_cluster(nodes=2, link="1gbit")
    out = tmp_path / "comm.json"
    res = runner.run(spec, ["distrain", "bench", "comm", "--sizes", "1M", "--algorithms", "star,ring,native",
                            "--warmup", "1", "--iters", "2", "--predict", "--json", str(out)], timeout=240, echo=False)
    assert res.returncode == 0, "\n".join(res.output[-30:])
    lines = [line.removeprefix("[node 0] ") for line in res.output if line.startswith("[node 0] ")]
    # the calibration ran (one inter-node pair), then the table of measured against predicted
    assert any(line.startswith("[link] 0 <-> 1 (inter): alpha ") for line in lines), "\n".join(lines)
    head = lines.index(next(line for line in lines if line.lstrip("# ").rstrip() == "cost model vs measured"))
    assert lines[head + 1].split() == ["#", "op", "algorithm", "P", "size", "measured_us", "predicted_us", "error"]
    rows = {cells[1]: cells for cells in (line.split() for line in lines[head + 2:head + 5])}
    assert set(rows) == {"star", "ring", "native"}
    for alg in ("star", "ring"):
        op, _, P, size, measured, predicted, error = rows[alg]
        assert (op, P, size) == ("all_reduce", "2", "1M")
        assert float(measured) > 0 and float(predicted) > 0 and error.endswith("%")
    assert rows["native"][5:] == ["-", "-"]  # no schedule to model for Gloo's own
    recs = {r["algorithm"]: r for r in json.loads(out.read_text())["records"]}
    assert recs["native"]["predicted_us"] is None and recs["native"]["predicted_error_pct"] is None
    for r in (recs["star"], recs["ring"]):
        assert r["placement"] == [0, 1] and r["size_bytes"] == 1 << 20
        assert r["predicted_error_pct"] == pytest.approx(100 * (r["predicted_us"] - r["time_us"]) / r["time_us"])
    # each prediction is the model's on the links the run calibrated (recorded beside it)
    from distrain.costmodel import Fabric, predict
    from distrain.costmodel.links import Link

    def fabric(d, host=True):
        return Fabric((0, 1), Link(d["inter"]["alpha_us"] * 1e-6, d["inter"]["bandwidth_GBps"] * 1e9),
                      Link(d["intra"]["alpha_us"] * 1e-6, d["intra"]["bandwidth_GBps"] * 1e9),
                      d["gamma_ns_per_byte"] * 1e-9, host=d["host_GBps"] * 1e9 if host and d["host_GBps"] else None,
                      handshake=d["handshake"], fan_sizes=tuple(d["fan_sizes"]),
                      fan_in=tuple(map(tuple, d["fan_in"])), fan_out=tuple(map(tuple, d["fan_out"])))

    for r in (recs["star"], recs["ring"]):
        assert r["predicted_us"] == pytest.approx(predict("all_reduce", r["algorithm"], 1 << 20, fabric(r["fabric"])).seconds * 1e6)
    # the seeds' claim: at P = 2 the star moves N each way in turn, the ring N/2 twice each way at once, so
    # on the calibrated links the ring saves one whole N-byte transfer (and reduces N/2 bytes, not N); both
    # pay two latencies, so the ratio passes 1.5 only where N·β outweighs 4α (a loaded host's α is ms).
    # Where the calibration found one machine carrying every node's packets (host_GBps), both directions
    # share it and the ring's gain shrinks, never reverses.
    N, links = 1 << 20, fabric(recs["ring"]["fabric"], host=False)
    star, ring = (predict("all_reduce", a, N, links).seconds for a in ("star", "ring"))
    assert star - ring == pytest.approx(N * links.inter.beta + N / 2 * links.gamma)
    if links.inter.alpha * 4 < N * links.inter.beta:
        assert star > 1.5 * ring
    assert recs["star"]["predicted_us"] >= recs["ring"]["predicted_us"]


@pytest.mark.timeout(60)
def test_bench_elastic_reports_a_replacement_that_did_not_join_in_time():
    """``bench elastic`` scaled down (few steps after --kill-step) can end before the replacement joins: the
    report says so instead of failing on the missing time (it crashed on None)."""
    from distrain.bench.elastic import cost

    s = cost.Settings(nproc=2, model="gpt-tiny", steps=8, kill_step=4)
    summary = {"fixed_step_s": 0.033, "elastic_step_s": 0.048, "ratios": [1.43], "ratio_median": 1.43,
               "recover_s": 0.093, "redone": False, "join_s": None, "join_recover_s": 0.05, "join_changes": 1}
    assert cost.format_report(s, summary).splitlines()[-1].split("  ")[-1] == (
        "none: the replacement had not joined when the run ended (give more --steps after --kill-step)")
    joined = cost.format_report(s, dict(summary, join_s=1.25))
    assert joined.splitlines()[-1].endswith("1.250 s (kill to the first step with it: 0.050 s)")
