"""distrain bench zero: one record per strategy, measured bytes that follow the sharding, JSON."""

from __future__ import annotations

import json

import pytest

from distrain.cli import main


@pytest.mark.timeout(600)
def test_bench_zero_records_every_strategy(tmp_path, capsys):
    out = tmp_path / "zero.json"
    rc = main(["bench", "zero", "--nproc", "2", "--model", "gpt-tiny", "--n-embd", "32", "--n-layer", "2",
               "--steps", "1", "--warmup", "1", "--json", str(out)])
    assert rc == 0
    recs = {r["strategy"]: r for r in json.loads(out.read_text())["records"]}
    assert set(recs) == {"ddp", "zero1", "zero2", "zero3", "torch-ddp", "torch-zero1", "torch-fsdp"}
    psi = recs["ddp"]["psi"]
    # same model and AdamW: our DDP and torch's hold the same parameters, gradients and state
    for k in ("params_bytes", "grads_bytes", "optimizer_bytes"):
        assert recs["ddp"][k] == recs["torch-ddp"][k]
    assert recs["ddp"]["params_bytes"] == recs["ddp"]["grads_bytes"] == 4 * psi
    assert recs["ddp"]["buffers_bytes"] == 4 * psi  # our DDP's gradient buckets
    # sharded: at most ceil(N/P) per unit, i.e. within a few elements per unit of Psi/P
    assert 4 * psi / 2 <= recs["zero3"]["params_bytes"] < 4 * psi / 2 + 4 * 16
    assert recs["zero2"]["grads_bytes"] == recs["zero3"]["grads_bytes"] < recs["zero1"]["grads_bytes"]
    assert all(r["peak_mem_bytes"] > 0 and r["step_ms"] > 0 for r in recs.values())
    assert recs["zero3"]["bytes_sent_per_step"] > recs["zero2"]["bytes_sent_per_step"] > 0
    assert "torch-fsdp" in capsys.readouterr().out
