"""`distrain bench train` runs real jobs side by side and reports consistent numbers."""

from __future__ import annotations

import json

import pytest

from distrain.cli import main


@pytest.mark.timeout(300)
def test_bench_train_end_to_end(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = main(["bench", "train", "--nproc", "2", "--strategies", "ddp,torch-ddp,zero2,local", "--model", "mlp-tiny",
                 "--steps", "3", "--warmup", "1", "--batch-size", "16", "--json", str(out)])
    assert code == 0
    records = {(r["nproc"], r["strategy"]): r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {(1, "single"), (2, "ddp"), (2, "torch-ddp"), (2, "zero2"), (2, "local")}
    # local: the same two ranks without any gradient exchange, the floor each strategy is measured against
    local = records[(2, "local")]
    assert [t["sent"] for t in local["bytes_per_rank"]] == [0, 0] and local["over_local"] is None
    # zero2's ring reduce-scatter of the padded 6,570 gradients (3,285 per rank) and all-gather
    # of the updated shards: each rank sends its peer's half, then its own
    assert [t["sent"] for t in records[(2, "zero2")]["bytes_per_rank"]] == [2 * 3285 * 4] * 2
    for s in ("ddp", "torch-ddp", "zero2"):
        assert records[(2, s)]["over_local"] == pytest.approx(1 - local["step_ms"] / records[(2, s)]["step_ms"])
    single, ddp, peer = records[(1, "single")], records[(2, "ddp")], records[(2, "torch-ddp")]
    assert single["speedup"] == 1.0 and single["efficiency"] == 1.0
    assert ddp["vs_torch_ddp"] == pytest.approx(ddp["throughput"] / peer["throughput"])
    assert ddp["efficiency"] == pytest.approx(ddp["throughput"] / single["throughput"] / 2)
    # ring all-reduce of mlp-tiny's 6,570 fp32 gradients on 2 ranks: each rank sends N/2 twice
    assert [t["sent"] for t in ddp["bytes_per_rank"]] == [6570 * 4, 6570 * 4]
    table = capsys.readouterr().out
    assert "vs torch-ddp" in table and "over local" in table


@pytest.mark.timeout(120)
def test_bench_train_single_threads(tmp_path, capsys):
    import os

    out = tmp_path / "s.json"
    assert main(["bench", "train", "--nproc", "2", "--strategies", "single-threads", "--model", "mlp-tiny",
                 "--steps", "2", "--warmup", "1", "--batch-size", "16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    records = {(r["nproc"], r["strategy"]): r for r in data["records"]}
    assert set(records) == {(1, "single"), (1, "single-threads")}  # one process, whatever --nproc is
    st = records[(1, "single-threads")]
    assert st["threads"] == len(os.sched_getaffinity(0)) and st["throughput"] > 0 and st["unit"] == "samples"
    assert st["speedup"] == pytest.approx(st["throughput"] / records[(1, "single")]["throughput"])
    assert data["meta"]["background_load"] == 0
    assert sorted(w["strategy"] for w in data["meta"]["loadavg_per_measurement"]) == ["single", "single-threads"]
    assert "single-threads" in capsys.readouterr().out


def test_bench_train_single_threads_in_every_round():
    from distrain.bench.train import throughput as train_bench

    # beside single, once whatever --nproc is; rotated with the others in every round like local
    assert train_bench._jobs([1, 2, 4], ["ddp", "local", "single-threads"], 1) == [
        (1, "single", "torch"), (1, "single-threads", "torch"), (2, "ddp", "torch"), (2, "local", "torch"),
        (4, "ddp", "torch"), (4, "local", "torch")]


def test_bench_train_bad_flags():
    assert main(["bench", "train", "--strategies", "allreduce"]) == 2
    assert main(["bench", "train", "--model", "resnet"]) == 2


def test_bench_train_sends_torchs_sharded_strategies_to_bench_zero(capsys):
    assert main(["bench", "train", "--strategies", "ddp,zero3,torch-fsdp"]) == 2
    err = capsys.readouterr().err
    assert "--strategies torch-fsdp:" in err and "distrain bench zero --strategies ddp,zero3,torch-fsdp" in err


@pytest.mark.timeout(120)
def test_bench_tp_ledger_equals_megatron_count(capsys):
    # exit status 0 only if the ledger equals the expected all-reduce calls and bytes exactly
    assert main(["bench", "tp", "--tp", "2", "--model", "gpt-tiny", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "ledger equals Megatron's count exactly" in out
    assert "| forward | 12 | 37,248 |" in out  # gpt-tiny: 9 x 2*16*32*4 + 3 x 2*16*4


@pytest.mark.timeout(120)
def test_bench_pipeline_table(tmp_path, capsys):
    assert main(["bench", "pipeline", "--pp", "2", "--m", "2", "--repeats", "1", "--json", str(tmp_path / "p.json")]) == 0
    rows = json.loads((tmp_path / "p.json").read_text())
    assert {(r["p"], r["m"], r["schedule"]) for r in rows} == {(2, 2, "gpipe"), (2, 2, "1f1b"), (2, 2, "zb-h1")}
    # (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(3m+p-1) for ZB-H1 (W passes fill the bubble)
    assert {r["schedule"]: r["expected"] for r in rows} == pytest.approx({"gpipe": 1 / 3, "1f1b": 1 / 3, "zb-h1": 1 / 7})
    assert [r["peak_held"] for r in rows if r["schedule"] == "1f1b"] == [[2, 1]]
