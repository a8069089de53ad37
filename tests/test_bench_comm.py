"""`distrain bench comm`: flag parsing, the nccl-tests size/bandwidth convention, the
median-of-max reduction, and one tiny end-to-end run through the CLI."""

from __future__ import annotations

import argparse
import json

import pytest

from distrain import cli
from distrain.bench import common
from distrain.bench.comm import collectives as comm_bench
from distrain.cli import bench_comm as bench_cli
from distrain.errors import ConfigError


# -- sizes ------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [
    ("4K", 4096), ("256K", 262144), ("4M", 4 << 20), ("64M", 64 << 20), ("1G", 1 << 30),
    ("4096", 4096), ("4k", 4096), ("4KB", 4096), ("4KiB", 4096), (" 16M ", 16 << 20), ("1", 1),
])
def test_parse_size(text, want):
    assert common.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "K", "4T", "-4K", "0", "1.5M", "4 K B x", "abc", "0K"])
def test_parse_size_rejects(text):
    with pytest.raises(ConfigError, match="size"):
        common.parse_size(text)


def test_parse_sizes_list_and_format():
    assert common.parse_sizes("4K,256K,4M,16M,64M") == [4096, 262144, 4 << 20, 16 << 20, 64 << 20]
    assert common.parse_sizes("4K, 4K,1M") == [4096, 1 << 20]  # duplicates dropped, order kept
    assert [common.format_size(s) for s in (4096, 262144, 4 << 20, 1 << 30, 1000)] == ["4K", "256K", "4M", "1G", "1000"]
    with pytest.raises(ConfigError):
        common.parse_sizes(",")


# -- nccl-tests convention at P = 4 -------------------------------------------------------

def test_busbw_factors_p4():
    # hand numbers: all_reduce 2*(4-1)/4 = 1.5; (4-1)/4 = 0.75; broadcast/reduce 1
    want = {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "scatter": 0.75,
            "gather": 0.75, "broadcast": 1.0, "reduce": 1.0, "barrier": None}
    assert {op: comm_bench.busbw_factor(op, 4) for op in want} == want
    assert comm_bench.busbw_factor("all_reduce", 2) == 1.0
    with pytest.raises(ConfigError):
        comm_bench.busbw_factor("all_to_all", 4)


def test_sizes_and_counts_p4():
    # 4 MiB of float32 at P = 4: all_reduce passes 1 Mi elements; all_gather 256 Ki per rank
    S = 4 << 20
    assert comm_bench.per_rank_count("all_reduce", S, 4, 4) == 1 << 20
    assert comm_bench.per_rank_count("broadcast", S, 4, 4) == 1 << 20
    for op in ("all_gather", "reduce_scatter", "scatter", "gather"):
        n = comm_bench.per_rank_count(op, S, 4, 4)
        assert n == 1 << 18 and comm_bench.full_size(op, n, 4, 4) == S
    # not divisible: 1000 bytes at P=3, float32 -> 83 elements per rank, S = 3*83*4 = 996
    n = comm_bench.per_rank_count("all_gather", 1000, 3, 4)
    assert (n, comm_bench.full_size("all_gather", n, 3, 4)) == (83, 996)
    # algbw = S / t in GB/s (1e9), busbw = algbw * factor: 4 MiB in 1 ms at P=4
    algbw, busbw = comm_bench.bandwidths("all_reduce", S, 4, 1e-3)
    assert algbw == pytest.approx(4.194304) and busbw == pytest.approx(4.194304 * 1.5)
    assert comm_bench.bandwidths("all_gather", S, 4, 1e-3)[1] == pytest.approx(4.194304 * 0.75)
    assert comm_bench.bandwidths("barrier", 0, 4, 1e-3) == (None, None)


# -- the statistic ---------------------------------------------------------------------

def test_median_of_max_over_ranks():
    times = [  # [rank][iteration]
        [1.0, 5.0, 2.0, 9.0, 3.0],
        [2.0, 1.0, 7.0, 1.0, 3.5],
        [1.5, 4.0, 1.0, 2.0, 8.0],
    ]
    assert common.slowest_rank_times(times) == [2.0, 5.0, 7.0, 9.0, 8.0]
    assert common.median_of_max(times) == 7.0
    assert common.median([4.0, 1.0, 3.0, 2.0]) == 2.5  # even count: mean of the middle two
    with pytest.raises(ValueError):
        common.slowest_rank_times([[1.0, 2.0], [1.0]])


def test_adaptive_iters_rule():
    assert common.adaptive_iters(0.1) == 5  # ceil(0.5/0.1) = 5
    assert common.adaptive_iters(1.0) == 5  # at least 5
    assert common.adaptive_iters(0.03) == 17  # ceil(16.67)
    assert common.adaptive_iters(1e-5) == 50  # at most 50


def test_table_formatting():
    txt = common.format_table([("", ["size"]), ("ring", ["time", "busbw"])], [["4096", "12.0", "0.50"]], "t")
    lines = txt.splitlines()
    assert lines[0] == "# t" and "ring" in lines[1] and lines[-1].split() == ["4096", "12.0", "0.50"]


# -- flags ------------------------------------------------------------------------------

def _args(**kw):
    p = argparse.ArgumentParser()
    bench_cli.add_comm_arguments(p)
    argv = []
    for k, v in kw.items():
        argv += [f"--{k}", v]
    return p.parse_args(argv)


def test_defaults_parse():
    cfg = bench_cli.comm_config(_args())
    assert cfg["nprocs"] == [2, 4] and cfg["ops"] == ["all_reduce"]
    assert cfg["algorithms"] == ["native", "star", "ring", "tree"] and cfg["iters"] is None
    cfg = bench_cli.comm_config(_args(nproc="4", ops="all", sizes="1K"))
    assert cfg["nprocs"] == [4] and len(cfg["ops"]) == 8 and cfg["sizes"] == [1024]


@pytest.mark.parametrize("flag,value,match", [
    ("ops", "all_reduce,allreduce", "allreduce"),
    ("algorithms", "ring,butterfly", "butterfly"),
    ("sizes", "4X", "bad size"),
    ("nproc", "two", "--nproc"),
    ("nproc", "0", "--nproc"),
    ("dtype", "float128", "--dtype"),
    ("iters", "0", "--iters"),
    ("burst", "0", "--burst"),
    ("warmup", "-1", "--warmup"),
    ("timeout", "0", "--timeout"),
])
def test_bad_flags_raise_config_error(flag, value, match):
    with pytest.raises(ConfigError, match=match):
        bench_cli.comm_config(_args(**{flag: value}))


def test_bad_flags_exit_2(capsys):
    assert cli.main(["bench", "comm", "--ops", "allreduce"]) == 2
    assert "unknown value(s) 'allreduce'" in capsys.readouterr().err
    assert cli.main(["bench", "comm", "--sizes", "4Q"]) == 2
    assert "bad size '4Q'" in capsys.readouterr().err


# -- end to end -------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_end_to_end_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = cli.main(["bench", "comm", "--nproc", "2", "--ops", "all_reduce", "--algorithms", "native,ring",
                   "--sizes", "4K", "--iters", "3", "--burst", "4", "--warmup", "1", "--json", str(out),
                   "--timeout", "90"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "all_reduce  P=2" in table and "ring/native" in table and "4096" in table
    data = json.loads(out.read_text())
    meta, recs = data["meta"], data["records"]
    assert meta["torch"] and meta["cpu_count"] and meta["date"] and "bench comm" in meta["command"]
    assert 0.1 < meta["memcpy_GBps"] < 1000  # this machine's memory copy rate, beside every bandwidth
    assert f"# memcpy on this machine just after (64 MiB, one thread, median of 10): {meta['memcpy_GBps']:.1f} GB/s" \
        in table
    assert [(r["P"], r["op"], r["algorithm"], r["size_bytes"]) for r in recs] == [
        (2, "all_reduce", "native", 4096), (2, "all_reduce", "ring", 4096)]
    for r in recs:
        assert r["count"] == 1024 and r["iters"] == 3 and r["burst"] == 4 and len(r["times_us"]) == 3
        assert r["time_us"] > 0 and r["algbw_GBps"] > 0
        assert r["time_us"] == pytest.approx(common.median(r["times_us"]), rel=1e-12)
        assert r["algbw_GBps"] == pytest.approx(r["size_bytes"] / (r["time_us"] / 1e6) / 1e9, rel=1e-12)
        assert r["busbw_GBps"] == r["algbw_GBps"] * comm_bench.busbw_factor("all_reduce", 2)
    native, ring = recs
    assert native["bytes_sent_max_rank"] is None  # Gloo's own traffic is invisible to the ledger
    assert ring["bytes_sent_max_rank"] == 4096  # ring at P=2: 2*(P-1)*N/P = N bytes per rank


def test_plot_without_matplotlib_says_how_to_install(monkeypatch):
    import sys

    from distrain.errors import DistrainError

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(DistrainError, match="pip install matplotlib"):
        common.require_pyplot()
    assert cli.main(["bench", "comm", "--plot", "x.png"]) == 2  # checked before measuring


def test_plot_writes_png(tmp_path):
    recs = [{"P": 2, "op": "all_reduce", "algorithm": a, "size_bytes": s, "busbw_GBps": 0.1 * i}
            for i, a in enumerate(["native", "ring"], 1) for s in (4096, 1 << 20)]
    out = tmp_path / "p.png"
    comm_bench.plot(recs, ["native", "ring"], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_markdown_tables(tmp_path):
    from distrain.cli import main

    md = tmp_path / "t.md"
    assert main(["bench", "comm", "--nproc", "2", "--ops", "all_reduce", "--algorithms", "native,tree",
                 "--sizes", "4K", "--iters", "2", "--warmup", "1", "--markdown", str(md)]) == 0
    text = md.read_text()
    assert text.startswith("**all_reduce, P=2** (time in µs, bandwidths in GB/s)")
    assert "| size | count | native us | native algbw | native busbw | tree us |" in text
    assert "\n| 4K | 1024 |" in text


def test_symmetric_needs_native_on_shared_memory(capsys):
    assert cli.main(["bench", "comm", "--symmetric"]) == 2  # transport torch only: nothing to compare
    assert ("--symmetric: times native on symmetric buffers of a shared-memory transport; add shm (or auto) to "
            "--transport and native to --algorithms") in capsys.readouterr().err
    assert cli.main(["bench", "comm", "--symmetric", "--transport", "shm", "--algorithms", "ring"]) == 2


@pytest.mark.timeout(120)
def test_symmetric_column_end_to_end(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = cli.main(["bench", "comm", "--nproc", "2", "--ops", "all_reduce,all_gather", "--algorithms", "native",
                   "--transport", "torch,shm", "--symmetric", "--sizes", "4K,1M", "--iters", "3", "--burst", "2",
                   "--warmup", "1", "--json", str(out), "--timeout", "90"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "native@shm+sym" in table
    data = json.loads(out.read_text())
    assert "--symmetric" in data["meta"]["command"]
    cells = [(r["op"], r["algorithm"], r["transport"], r["size_bytes"]) for r in data["records"]]
    assert cells == [(op, alg, t, size) for op in ("all_reduce", "all_gather") for size in (4096, 1 << 20)
                     for alg, t in (("native", "torch"), ("native@shm", "shm"), ("native@shm+sym", "shm+sym"))]


@pytest.mark.timeout(120)
def test_python_kernels_and_deepspeed_columns(tmp_path, capsys):
    """shm-python times the Python reference beside the compiled plane, in the same rounds; the
    deepspeed column is DeepSpeed's op when it is importable, and refused in one line where it is
    not or where its op cannot do the asked collective."""
    from distrain.bench.comm import columns

    out = tmp_path / "k.json"
    transports = "torch,shm,shm-python" + ("" if columns.deepspeed_missing() else ",deepspeed")
    rc = cli.main(["bench", "comm", "--nproc", "2", "--ops", "all_reduce", "--algorithms", "native",
                   "--transport", transports, "--sizes", "4K", "--iters", "3", "--burst", "2", "--warmup", "1",
                   "--json", str(out), "--timeout", "90"])
    assert rc == 0
    records = json.loads(out.read_text())["records"]
    want = [("native", "torch"), ("native@shm", "shm"), ("native@shm-python", "shm-python")]
    want += [] if columns.deepspeed_missing() else [("deepspeed", "deepspeed")]
    assert [(r["algorithm"], r["transport"]) for r in records] == want
    assert all(r["time_us"] > 0 for r in records)
    capsys.readouterr()
    assert cli.main(["bench", "comm", "--transport", "torch,deepspeed", "--ops", "broadcast"]) == 2
    err = capsys.readouterr().err
    assert ("--transport deepspeed: DeepSpeed's shared-memory op is an all_reduce (sum) of float32, bfloat16, "
            "float16 only" in err) or "--transport deepspeed: deepspeed is not importable" in err
