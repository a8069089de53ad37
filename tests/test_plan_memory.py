"""`distrain plan` always checks memory: without --device against a rank's memory (--memory-gb, else this
host's available memory over the ranks of a node), with --device against the device's (or --memory-gb); a
layout over it is never ranked; both planners print one table shape, every row aligned; the "no layout
fits" hint never suggests what the layout already uses."""

from __future__ import annotations

import re

import pytest

from distrain.cli import main
from distrain.costmodel.table import COLUMNS

LLAMA = "plan --model llama-3-8b --nodes 4 --procs-per-node 2 --compute-ms 1000".split()
CLUSTER = "plan --model llama-3-8b --device h100 --nodes 4 --gpus-per-node 8 --link ib-400g --seq-len 4096".split()


def _tables(out: str) -> list[list[str]]:
    """The table's lines (not the # lines) cut into their cells: columns are two spaces or more apart."""
    return [re.split(r"\s{2,}", ln.strip()) for ln in out.splitlines() if not ln.startswith(("#", "best:"))]


def _mem_mb(row: list[str]) -> float:
    return float(row[COLUMNS.index("mem MB")])


def test_plan_ranks_only_the_layouts_that_fit_a_rank_given_memory(capsys):
    assert main([*LLAMA, "--memory-gb", "800"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].endswith("; memory: 800 GB per rank (--memory-gb)")
    rows = _tables(out)
    assert rows[0] == list(COLUMNS)
    ranked = [r for r in rows[1:] if r[0] != "-"]
    assert [(r[0], r[1], _mem_mb(r)) for r in ranked] == [
        ("1", "dp2 x tp2 x pp2 (ring)", 792330.3), ("2", "dp4 x tp2 x pp1 (ring)", 444346.7)]
    assert "# 2 layouts fit, 10 do not fit 800 GB per rank:" in lines
    unranked = rows[1 + len(ranked):]
    assert len(unranked) == 10 and all(_mem_mb(r) > 800e3 for r in unranked)
    assert [_mem_mb(r) for r in unranked] == sorted(_mem_mb(r) for r in unranked)  # smallest first


def test_plan_checks_this_hosts_memory_over_the_ranks_of_a_node(capsys, monkeypatch):
    import distrain.runtime

    monkeypatch.setattr(distrain.runtime, "available_memory", lambda: 1000e9)
    assert main(LLAMA) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("; memory: 1000.0 GB available here / 2 ranks per node (--memory-gb sets a rank's)")
    assert "# 1 layouts fit, 11 do not fit 500 GB per rank:" in lines
    # nothing fits: every layout listed unranked, and one line says what would help (exit 0: a plan, not an error)
    monkeypatch.setattr(distrain.runtime, "available_memory", lambda: 24e9)
    assert main(LLAMA) == 0
    out = capsys.readouterr().out
    assert all(r[0] == "-" for r in _tables(out)[1:]) and len(_tables(out)) == 13
    assert out.splitlines()[-1] == ("# no layout fits: the smallest, dp4 x tp2 x pp1 (ring), needs 444.3 GB per rank; "
                                    "add nodes (--nodes: more pipeline stages), give ranks more memory (--memory-gb) "
                                    "or plan a smaller model")


def test_cluster_plan_ranks_only_what_fits_the_memory_given(capsys):
    assert main([*CLUSTER, "--memory-gb", "30", "--top", "200"]) == 0
    out = capsys.readouterr().out
    assert "32 devices (30 GB each, --memory-gb)" in out.splitlines()[0]
    rows = _tables(out)[1:]
    assert len(rows) == 200 and all(_mem_mb(r) <= 30e3 for r in rows)
    fit, over = map(int, re.search(r"# (\d+) layouts fit, (\d+) do not", out).groups())
    assert (fit, over) == (1706, 1150)
    assert main([*CLUSTER, "--memory-gb", "0"]) == 2
    assert capsys.readouterr().err == "distrain: error: --memory-gb must be a positive number of GB, got 0.0\n"


@pytest.mark.parametrize("argv", [
    [*LLAMA, "--memory-gb", "100"],
    [*CLUSTER, "--recompute", "selective", "--top", "5"],  # rc-sel rows: longer names
    "plan --model gpt-small --nodes 2 --procs-per-node 2 --compute-ms 100 --memory-gb 1".split(),
])
def test_both_planners_print_one_table_shape(capsys, argv):
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = [ln for ln in out.splitlines() if not ln.startswith(("#", "best:"))]
    cells = _tables(out)
    assert cells[0] == list(COLUMNS) and all(len(c) == len(COLUMNS) for c in cells)
    assert len({len(ln) for ln in table}) == 1  # every right-aligned column ends where its header does
    assert len(cells) > 4 and ("--recompute" not in argv or all(c[1].endswith(" rc-sel") for c in cells[1:]))


@pytest.mark.parametrize("flags,hint", [
    # every field fixed: each one that could shrink the layout is named
    ("--dp 8 --tp 1 --pp 1 --cp 1 --zero 0 --micro-batch 2 --recompute none",
     "leave --tp/--pp/--cp open (or larger), --zero 3, --recompute full, --micro-batch 1 or a device with more memory"),
    # the layout already uses ZeRO-3 and full recomputation: never suggested again
    ("--tp 8 --pp 1 --zero 3 --recompute full", "leave --tp/--pp open (or larger) or add devices (--nodes)"),
    # nothing fixed: the search tried every value, so only more devices can help
    ("", "add devices (--nodes)"),
])
def test_no_layout_fits_suggests_only_what_the_layout_does_not_use(capsys, flags, hint):
    argv = f"plan --model llama-3-70b --device a100-40g --nodes 1 --seq-len 4096 --batch-size 16 {flags}".split()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("distrain: error: no layout fits: the smallest, ") and err.endswith(f"40 GB; {hint}\n")


def test_available_memory_is_the_kernels_memavailable(tmp_path):
    from distrain.runtime import available_memory

    (tmp_path / "meminfo").write_text("MemTotal:       24684084 kB\nMemFree:  1 kB\nMemAvailable:   21840584 kB\n")
    assert available_memory(str(tmp_path / "meminfo")) == 21840584 * 1024
    (tmp_path / "none").write_text("MemTotal:       24684084 kB\n")
    assert available_memory(str(tmp_path / "none")) is None
    assert available_memory(str(tmp_path / "missing")) is None
