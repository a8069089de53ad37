"""`distrain bench train` runs real jobs side by side and reports consistent numbers."""

from __future__ import annotations

import json

import pytest

from distrain.cli import main


@pytest.mark.timeout(300)
def test_bench_train_end_to_end(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = main(["bench", "train", "--nproc", "2", "--strategies", "ddp,torch-ddp", "--model", "mlp-tiny",
                 "--steps", "3", "--warmup", "1", "--batch-size", "16", "--json", str(out)])
    assert code == 0
    records = {(r["nproc"], r["strategy"]): r for r in json.loads(out.read_text())["records"]}
    assert set(records) == {(1, "single"), (2, "ddp"), (2, "torch-ddp")}
    single, ddp, peer = records[(1, "single")], records[(2, "ddp")], records[(2, "torch-ddp")]
    assert single["speedup"] == 1.0 and single["efficiency"] == 1.0
    assert ddp["vs_torch_ddp"] == pytest.approx(ddp["throughput"] / peer["throughput"])
    assert ddp["efficiency"] == pytest.approx(ddp["throughput"] / single["throughput"] / 2)
    # ring all-reduce of mlp-tiny's 6,570 fp32 gradients on 2 ranks: each rank sends N/2 twice
    assert [t["sent"] for t in ddp["bytes_per_rank"]] == [6570 * 4, 6570 * 4]
    assert "vs torch-ddp" in capsys.readouterr().out


def test_bench_train_bad_flags():
    assert main(["bench", "train", "--strategies", "allreduce"]) == 2
    assert main(["bench", "train", "--model", "resnet"]) == 2
