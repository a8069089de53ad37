"""The studies behind the documents' tables, as ``distrain bench`` subcommands (cli/bench_studies.py):
their flags reach the typed ``run`` of each study, and bad input is one line before any work."""

from __future__ import annotations

import glob
import json
from pathlib import Path

import pytest

from distrain.bench.comm import predict
from distrain.cli import main

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
