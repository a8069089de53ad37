"""`distrain plan` without --device checks memory too: it never ranks a layout over a rank's memory (this
machine's, or --memory-gb), keeps its columns aligned whatever the numbers, and says in one line when
nothing fits."""

from __future__ import annotations

from distrain.cli import main

LLAMA = ["plan", "--model", "llama-3-8b", "--nodes", "4", "--procs-per-node", "2", "--compute-ms", "1000"]


def test_plan_ranks_only_the_layouts_that_fit_the_memory(capsys):
    assert main([*LLAMA, "--memory-gb", "900"]) == 0
    out = capsys.readouterr().out.splitlines()
    table = [ln for ln in out if not ln.startswith("#")]
    mem = [float(ln.split()[-2]) for ln in table[1:]]
    assert mem == [792330.3, 824451.3, 444346.7]  # MB per rank, ranked by step time: all under 900 GB
    assert out[-1] == "# 3 layouts fit in 900.0 GB per rank (--memory-gb), 9 do not"
    # one table shape: every line as long as the header, each column ending where the header's does
    assert {len(ln) for ln in table} == {len(table[0])}
    assert all(ln[len(table[0]) - len("busiest link MB") - 1] == " " for ln in table)


def test_plan_says_in_one_line_when_no_layout_fits(capsys):
    assert main([*LLAMA, "--memory-gb", "24"]) == 2
    err = capsys.readouterr().err
    assert err == ("distrain: error: no layout fits: the smallest, dp4 x tp2 x pp1 (ring), needs 444.3 GB per rank and "
                   "a rank has 24.0 GB (--memory-gb); add nodes (--nodes) or plan a smaller model\n")
