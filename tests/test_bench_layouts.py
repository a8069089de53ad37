"""`distrain bench layouts`: real trainer jobs per layout, step time and peak RSS per rank, JSON."""

from __future__ import annotations

import json

import pytest

from distrain.bench.train.layouts import Layout, parse_layout, plan_jobs
from distrain.cli import main
from distrain.errors import ConfigError
from distrain.models import build_model, count_parameters


@pytest.mark.timeout(180)
def test_bench_layouts_end_to_end(tmp_path, capsys):
    out = tmp_path / "layouts.json"
    rc = main(["bench", "layouts", "--model", "llama-tiny", "--nproc", "2", "--layouts", "ddp,tp2,tp2xpp2",
               "--steps", "2", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    meta, recs = data["meta"], {(r["nproc"], r["layout"]): r for r in data["records"]}
    assert set(recs) == {(1, "single"), (2, "ddp"), (2, "tp2")}
    # tp2xpp2 needs 4 ranks: skipped at P=2 with a note (in the JSON and the printout)
    assert meta["notes"] == ["tp2xpp2: tp*pp = 4 does not divide P=2; skipped at P=2"]
    assert len(meta["load_avg_start"]) == 3 and len(meta["load_avg_end"]) == 3
    assert (meta["model"], meta["steps"], meta["warmup"], meta["batch_size"]) == ("llama-tiny", 2, 1, 16)
    single, ddp, tp = recs[(1, "single")], recs[(2, "ddp")], recs[(2, "tp2")]
    assert (single["grid"], ddp["grid"], tp["grid"]) == ("dp1×tp1×pp1", "dp2×tp1×pp1", "dp1×tp2×pp1")
    assert (ddp["strategy"], ddp["dp"], tp["tp"], tp["pp"]) == ("ddp", 2, 2, 1)
    for r in recs.values():
        assert r["step_ms"] > 0 and len(r["step_ms_timed"]) == 2 and r["rounds"] == 1
        assert r["samples_per_s"] == pytest.approx(16 / (r["step_ms"] / 1e3))
        assert r["tokens_per_s"] == pytest.approx(32 * r["samples_per_s"])  # llama-tiny: block 32
        assert r["speedup"] == pytest.approx(r["samples_per_s"] / single["samples_per_s"])
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
        assert len(r["peak_mem_bytes_per_rank"]) == r["nproc"] == len(r["rss_before_model_bytes_per_rank"])
        assert r["peak_mem_bytes"] == max(r["peak_mem_bytes_per_rank"])
        # at least the model's parameters (fp32) live during a step, above the RSS before the model
        assert r["peak_mem_bytes"] > 4 * count_parameters(build_model("llama-tiny"))
    assert single["speedup"] == 1.0 and single["bytes_sent_per_step_max_rank"] == 0
    assert ddp["bytes_sent_per_step_max_rank"] > 0 and tp["bytes_sent_per_step_max_rank"] > 0
    # same seed, data and global batch: every layout trains the same model to (nearly) the same loss
    assert ddp["final_loss"] == pytest.approx(single["final_loss"], rel=1e-3)
    assert tp["final_loss"] == pytest.approx(single["final_loss"], rel=1e-3)
    printed = capsys.readouterr().out
    assert "samples/s" in printed and "peak RSS MB" in printed and "load average" in printed
    assert "note: tp2xpp2: tp*pp = 4 does not divide P=2; skipped at P=2" in printed


def test_bench_layouts_bad_layout_string(capsys):
    assert main(["bench", "layouts", "--layouts", "ddp,tp3x"]) == 2
    assert "--layouts: 'tp3x' has an empty part at the end" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"part 'mp2' is not dpN, tpN or ppN"):
        parse_layout("tp2xmp2")
    with pytest.raises(ConfigError, match=r"'tp2xtp2' gives tp twice"):
        parse_layout("tp2xtp2")
    with pytest.raises(ConfigError, match=r"'tp2xzero3': part 'zero3' is a strategy must come first"):
        parse_layout("tp2xzero3")
    with pytest.raises(ConfigError, match=r"tp must be >= 1, got tp0"):
        parse_layout("tp0")


def test_bench_layouts_rejects_layouts_the_model_cannot_take(capsys):
    # tp3 fits P=3 but not llama-tiny's 4 heads: the trainer's own check, before any job runs
    assert main(["bench", "layouts", "--model", "llama-tiny", "--nproc", "3", "--layouts", "tp3"]) == 2
    assert "--layouts tp3 at P=3 (dp1×tp3×pp1, --strategy ddp): tensor parallelism (tp=3) does not fit --model " \
           "llama-tiny: n_head=4 is not divisible by tp=3" in capsys.readouterr().err
    assert main(["bench", "layouts", "--model", "mlp"]) == 2


def test_layout_grids_and_skips():
    assert parse_layout("ddp") == Layout("ddp")
    assert parse_layout("zero3") == Layout("zero3", strategy="zero3")
    assert parse_layout("dp2xtp2") == Layout("dp2xtp2", dp=2, tp=2)
    assert parse_layout("zero1xpp2") == Layout("zero1xpp2", strategy="zero1", pp=2)
    layouts = [parse_layout(s) for s in ("ddp", "zero3", "tp2", "pp2", "dp2xtp2", "tp2xpp2")]
    jobs, notes = plan_jobs([2, 4], layouts)
    got = [(j.nproc, j.layout, j.strategy, j.dp, j.tp, j.pp, j.aliases) for j in jobs]
    assert got == [(1, "single", "single", 1, 1, 1, ()),
                   (2, "ddp", "ddp", 2, 1, 1, ()), (2, "zero3", "zero3", 2, 1, 1, ()),
                   (2, "tp2", "ddp", 1, 2, 1, ()), (2, "pp2", "ddp", 1, 1, 2, ()),
                   (4, "ddp", "ddp", 4, 1, 1, ()), (4, "zero3", "zero3", 4, 1, 1, ()),
                   (4, "tp2", "ddp", 2, 2, 1, ("dp2xtp2",)), (4, "pp2", "ddp", 2, 1, 2, ()),
                   (4, "tp2xpp2", "ddp", 1, 2, 2, ())]
    assert notes == ["dp2xtp2 needs exactly dp*tp*pp = 4 processes; skipped at P=2",
                     "tp2xpp2: tp*pp = 4 does not divide P=2; skipped at P=2",
                     "dp2xtp2 at P=4 is the same job as tp2 (dp2×tp2×pp1): measured once"]


@pytest.mark.timeout(180)
def test_bench_layouts_transport_reaches_every_job(tmp_path, capsys):
    out = tmp_path / "layouts_shm.json"
    rc = main(["bench", "layouts", "--model", "llama-tiny", "--nproc", "2", "--layouts", "ddp", "--transport", "shm",
               "--steps", "1", "--warmup", "0", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["transport"] == "shm"
    assert [(r["layout"], r["transport"]) for r in data["records"]] == [("single", "shm"), ("ddp", "shm")]
    ddp = data["records"][1]
    assert ddp["bytes_sent_per_step_max_rank"] > 0  # the ring's bytes, now over shared memory
    assert ddp["final_loss"] == pytest.approx(data["records"][0]["final_loss"], rel=1e-3)
    assert "transport shm" in capsys.readouterr().out  # the table's header


def test_bench_layouts_bad_transport(capsys):
    assert main(["bench", "layouts", "--transport", "udp"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == \
        ["distrain: error: --transport 'udp': choose one of torch, shm, auto"]


def test_expert_parallel_layouts_borrow_data_parallel_ranks():
    assert parse_layout("tp2xep2") == Layout("tp2xep2", tp=2, ep=2)
    jobs, notes = plan_jobs([2, 4], [parse_layout(s) for s in ("ep2", "ep4", "tp2xep2")])
    got = [(j.nproc, j.layout, j.dp, j.tp, j.ep, j.grid) for j in jobs]
    assert got == [(1, "single", 1, 1, 1, "dp1×tp1×pp1"), (2, "ep2", 2, 1, 2, "dp2×tp1×pp1×ep2"),
                   (4, "ep2", 4, 1, 2, "dp4×tp1×pp1×ep2"), (4, "ep4", 4, 1, 4, "dp4×tp1×pp1×ep4"),
                   (4, "tp2xep2", 2, 2, 2, "dp2×tp2×pp1×ep2")]
    assert notes == ["ep4: ep4 does not divide dp*cp = 2 at P=2; skipped",
                     "tp2xep2: ep2 does not divide dp*cp = 1 at P=2; skipped"]
