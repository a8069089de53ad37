"""``--background-load N``: the busy processes exist while a benchmark measures and never outlive it."""

from __future__ import annotations

import json
import os
import time

import pytest

from distrain.bench import background
from distrain.bench.comm import collectives as comm_bench
from distrain.bench.train import throughput as train_bench
from distrain.cli import main
from distrain.errors import ConfigError

CORES = len(os.sched_getaffinity(0))
TOP = 64 * CORES


def _state(pid: int) -> str | None:
    """The kernel's state letter of pid (R running, S sleeping, Z zombie...), None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")  # a zombie no longer runs; its reaper may be slow


def _wait_gone(pids, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(_gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


# -- the flag ---------------------------------------------------------------------------

def test_parse_range():
    assert background.parse("0") == 0 and background.parse(2) == 2 and background.parse(str(TOP)) == TOP


@pytest.mark.parametrize("value,message", [
    ("-1", f"--background-load -1: out of range; allowed: 0 to {TOP} (64 per usable core, {CORES} usable)"),
    (str(TOP + 1), f"--background-load {TOP + 1}: out of range; allowed: 0 to {TOP} (64 per usable core, "
                   f"{CORES} usable)"),
    ("two", f"--background-load 'two': not an integer; allowed: 0 to {TOP} (64 per usable core, {CORES} usable)"),
])
def test_bad_values_one_line(value, message, capsys):
    with pytest.raises(ConfigError) as e:
        background.parse(value)
    assert str(e.value) == message
    for bench in ("comm", "train"):  # checked before anything starts, in both benchmarks
        assert main(["bench", bench, "--background-load", value]) == 2
        assert capsys.readouterr().err == f"distrain: error: {message}\n"


# -- the processes ----------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_busy_while_inside_gone_after():
    with background.BackgroundLoad(2) as load:
        pids = load.pids
        assert len(pids) == 2 and background.running_pids() == pids
        for pid in pids:  # unpinned: the benchmark's own affinity, every usable core
            assert os.sched_getaffinity(pid) == os.sched_getaffinity(0)
        deadline = time.monotonic() + 10
        while not all(_cpu_ticks(p) > 0 for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_cpu_ticks(p) > 0 for p in pids)  # spinning, not sleeping
    assert all(_state(p) is None for p in pids)  # killed and reaped
    assert background.running_pids() == []
    with background.BackgroundLoad(0) as load:
        assert load.pids == []


@pytest.mark.timeout(60)
def test_gone_when_the_block_raises():
    with pytest.raises(RuntimeError, match="boom"):
        with background.BackgroundLoad(2) as load:
            pids = load.pids
            assert all(not _gone(p) for p in pids)
            raise RuntimeError("boom")
    assert all(_state(p) is None for p in pids)


@pytest.mark.timeout(60)
def test_die_with_a_killed_benchmark():
    # the benchmark's process is SIGKILLed inside the block: no finally runs, PR_SET_PDEATHSIG ends them
    # (the benchmark's process: a fork of this one, which has imported distrain already; a fresh interpreter
    # only added the torch import)
    import signal

    answers, answer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the benchmark
        try:
            os.close(answers)
            load = background.BackgroundLoad(2).start()
            os.write(answer, " ".join(map(str, load.pids)).encode())
            os.kill(os.getpid(), signal.SIGKILL)
        finally:
            os._exit(1)
    os.close(answer)
    with os.fdopen(answers, "rb") as f:
        said = f.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
    pids = [int(x) for x in said.split()]
    assert len(pids) == 2 and _wait_gone(pids)


# -- in the benchmarks ------------------------------------------------------------------

@pytest.fixture
def started(monkeypatch):
    """The pids of every busy process the benchmark starts."""
    pids: list[int] = []
    start = background.BackgroundLoad.start

    def recording(self):
        out = start(self)
        pids.extend(self.pids)
        return out

    monkeypatch.setattr(background.BackgroundLoad, "start", recording)
    return pids


@pytest.mark.timeout(120)
def test_bench_comm_records_the_load(tmp_path, capsys, started):
    out = tmp_path / "c.json"
    assert main(["bench", "comm", "--nproc", "2", "--algorithms", "native", "--sizes", "4K,8K", "--iters", "2",
                 "--burst", "2", "--warmup", "0", "--background-load", "2", "--json", str(out)]) == 0
    assert len(started) == 2 and all(_state(p) is None for p in started)
    meta = json.loads(out.read_text())["meta"]
    assert meta["background_load"] == 2 and "--background-load 2" in meta["command"]
    windows = meta["loadavg_per_measurement"]
    assert [(w["P"], w["size_bytes"]) for w in windows] == [(2, 4096), (2, 8192)]
    assert all(len(w["loadavg_start"]) == 3 and len(w["loadavg_end"]) == 3 for w in windows)
    assert "# background load: 2 busy processes on" in capsys.readouterr().out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("error,code", [(RuntimeError("rank failed"), None), (KeyboardInterrupt(), 130)])
def test_bench_comm_stops_the_load_on_error(monkeypatch, started, error, code):
    alive = []

    def failing(cfg):
        alive.extend(not _gone(p) for p in background.running_pids())
        raise error

    monkeypatch.setattr(comm_bench, "measure", failing)
    argv = ["bench", "comm", "--nproc", "2", "--sizes", "4K", "--background-load", "2"]
    if code is None:
        with pytest.raises(RuntimeError, match="rank failed"):
            main(argv)
    else:  # Ctrl-C
        assert main(argv) == code
    assert alive == [True, True] and len(started) == 2 and all(_state(p) is None for p in started)


@pytest.mark.timeout(60)
def test_bench_train_stops_the_load_on_error(monkeypatch, started):
    def failing(*a):
        assert len(background.running_pids()) == 3
        raise RuntimeError("job failed")

    monkeypatch.setattr(train_bench, "_measure", failing)
    with pytest.raises(RuntimeError, match="job failed"):
        main(["bench", "train", "--nproc", "2", "--strategies", "ddp", "--model", "mlp-tiny",
              "--background-load", "3"])
    assert len(started) == 3 and all(_state(p) is None for p in started)


@pytest.mark.timeout(60)
def test_bench_train_records_the_load(tmp_path, monkeypatch, capsys, started):
    def fake(cfg, args, batch, strategy):  # a job's record, without training
        assert len(background.running_pids()) == 2 and all(not _gone(p) for p in background.running_pids())
        return {"nproc": cfg.nproc, "strategy": train_bench._label(strategy, cfg.transport), "transport": "torch",
                "threads": None, "step_ms": 10.0, "unit": "samples", "throughput": 100.0 * cfg.nproc,
                "comm_share": None, "bytes_sent_max_rank": 0, "bytes_recv_max_rank": 0, "bytes_per_rank": []}

    monkeypatch.setattr(train_bench, "_measure", fake)
    out = tmp_path / "t.json"
    assert main(["bench", "train", "--nproc", "2", "--strategies", "local,single-threads", "--model", "mlp-tiny",
                 "--rounds", "2", "--background-load", "2", "--json", str(out)]) == 0
    assert len(started) == 2 and all(_state(p) is None for p in started)
    meta = json.loads(out.read_text())["meta"]
    assert meta["background_load"] == 2
    windows = meta["loadavg_per_measurement"]  # every job of every round, in the order run (rotated)
    assert [(w["round"], w["strategy"]) for w in windows] == [
        (1, "single"), (1, "single-threads"), (1, "local"), (2, "single-threads"), (2, "local"), (2, "single")]
    assert all(len(w["loadavg_start"]) == 3 and len(w["loadavg_end"]) == 3 for w in windows)
    assert "# background load: 2 busy processes on" in capsys.readouterr().out
