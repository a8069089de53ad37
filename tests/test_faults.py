"""Fault injection: signals to the top process, killed and hung ranks, a busy run folder,
a foreign MASTER_PORT, blame, restarts that resume. Each case asserts one precise outcome.

Long randomized trials are marked ``faults_long`` and deselected by default
(run them with ``pytest -m faults_long tests/test_faults.py``).
"""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import distrain
from conftest import descendants, process_tree
from distrain import comm, runlock
from distrain.blame import Failure, blame, is_secondary
from distrain.errors import CollectiveTimeoutError, CommError, ConfigError, RankFailedError

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--model", "mlp-tiny", "--data", "digits", "--no-progress", "--eval-every", "0", "--no-report"]


# -- helpers ---------------------------------------------------------------------------------

def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "DISTRAIN_PARENT_PID", "DISTRAIN_RESUME")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _start(*args: str) -> subprocess.Popen:
    """`distrain ARGS` in its own session (so a signal to its group reaches only it and its ranks)."""
    return subprocess.Popen([sys.executable, "-m", "distrain.cli", *args], env=_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    return process_tree().get(pid, [])


def _wait_for(cond, timeout: float, what: str, p: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if p is not None and p.poll() is not None:
            pytest.fail(f"{what}: process ended early with {p.returncode}:\n{p.stderr.read()}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def _metric_lines(out: Path) -> int:
    try:
        return len((out / "metrics.jsonl").read_text().splitlines())
    except OSError:
        return 0


def _training(p: subprocess.Popen, out: Path, ranks: int) -> set[int]:
    """Wait until the job writes metrics, return the pids under its top process."""
    _wait_for(lambda: _metric_lines(out) >= 1, 120, "the first metrics line", p)
    procs = descendants(p.pid)
    assert len(procs) >= ranks, procs
    return procs


def _finish(p: subprocess.Popen, timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail("the top process did not end after the signal")
    return p.returncode, err


def _no_orphans(procs: set[int]) -> None:
    _wait_for(lambda: not any(_alive(q) for q in procs), 30, f"ranks {sorted(procs)} to end")


# -- no orphans, whatever kills the top process ------------------------------------------------

@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", ["train", "launch"])
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_signal_to_the_top_process_takes_every_rank_down(tmp_path, command, sig):
    if command == "launch" and sig == signal.SIGHUP:
        pytest.skip("same torchrun handler as SIGTERM")
    out = tmp_path / "run"
    head = ["train", "--nproc", "2"] if command == "train" else ["launch", "--nproc-per-node", "2", "train"]
    p = _start(*head, *TINY, "--steps", "1000000", "--log-every", "1", "--out", str(out))
    procs = _training(p, out, 2)
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C reaches the whole foreground process group
    else:
        os.kill(p.pid, sig)
    code, err = _finish(p)
    _no_orphans(procs)
    lines_after = _metric_lines(out)
    time.sleep(1.5)
    assert _metric_lines(out) == lines_after  # nobody writes into --out any more
    if sig == signal.SIGKILL:
        assert code == -signal.SIGKILL
        return
    assert code == 128 + sig if sig != signal.SIGINT else code == 130
    last = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("W1")]  # W...: torchrun's banner
    want = ("distrain: interrupted (Ctrl-C); every rank was stopped" if command == "train" and sig == signal.SIGINT
            else f"distrain{' launch' if command == 'launch' else ''}: stopped by {signal.Signals(sig).name}; "
                 f"every rank was stopped")
    assert last == [want], err


# -- one run per folder ----------------------------------------------------------------------------

@pytest.mark.timeout(180)
def test_second_run_into_a_busy_folder_is_refused_and_the_lock_dies_with_its_holder(tmp_path, capsys):
    from distrain.cli import main

    out = tmp_path / "run"
    p = _start("train", "--nproc", "2", *TINY, "--steps", "1000000", "--out", str(out))
    procs = _training(p, out, 2)
    # the second run through the CLI's main here (the holder is another process; a subprocess would only import
    # torch while the holder's two ranks train, ~2.5 s of CPU plus theirs)
    capsys.readouterr()
    code = main(["train", "--nproc", "1", "--strategy", "single", *TINY, "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"distrain: error: --out {out} is in use by a running job (pid {p.pid} on ")
    assert err.rstrip().endswith("wait for it to end, stop it, or choose another --out")
    assert len(err.strip().splitlines()) == 1
    os.kill(p.pid, signal.SIGKILL)
    _finish(p)
    _no_orphans(procs)
    with runlock.hold(out) as lock:  # a SIGKILLed holder leaves no stale lock
        assert json.loads(lock.read_text())["pid"] == os.getpid()


def test_unwritable_out_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*/file/run: cannot create the run folder \(Not a directory\)"):
        with runlock.hold(blocker / "run"):
            pass
    with pytest.raises(ConfigError, match=r"--out .*/file exists and is not a folder"):
        with runlock.hold(blocker):
            pass


# -- rendezvous: a foreign service on MASTER_PORT, a loopback-only store -------------------------

@pytest.mark.timeout(90)
def test_init_against_a_silent_foreign_service_fails_instead_of_hanging():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)  # accepts connections (the kernel does) and never answers
    port = srv.getsockname()[1]
    env = _env() | {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    p = subprocess.run([sys.executable, "-c", "import distrain; distrain.runtime.init(timeout=2)"], env=env,
                       capture_output=True, text=True, timeout=80)
    srv.close()
    assert p.returncode == 1
    assert (f"CommError: rank 1: MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} accepts connections but does not answer "
            f"as a torch.distributed store (no reply in 2s)") in p.stderr


def _listening_addresses(port: int) -> list[str]:
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            local, state = ln.split()[1], ln.split()[3]
            addr, p = local.split(":")
            if state == "0A" and int(p, 16) == port:
                rows.append(addr)
    return rows


def test_local_store_listens_on_the_loopback_only():
    from distrain.launch import local_store

    store = local_store(2, 10)
    assert _listening_addresses(store.port) == ["0100007F"]  # 127.0.0.1, and no "*" or :: entry
    del store


# -- blame: the first rank that died, not the first survivor that complained ----------------------

def test_blame_prefers_the_dead_rank_over_an_earlier_connection_reset():
    fs = {0: Failure(0, 100.0, "CommError: ... Read error [127.0.0.1]:1: Connection reset by peer", secondary=True),
          1: Failure(1, 100.5, "process exited with code -9 before returning", died=True),
          2: Failure(2, 100.2, "CommError: ... Connection closed by peer", secondary=True)}
    err = blame(fs)
    assert isinstance(err, RankFailedError) and err.rank == 1 and err.also_failed == [0, 2]
    # two primary failures: the earlier one
    fs[2] = Failure(2, 99.0, "ValueError: bad batch")
    assert blame(fs).rank == 2
    # only secondary failures: the earliest of them
    assert blame({3: Failure(3, 5.0, "x reset", secondary=True), 4: Failure(4, 4.0, "y", secondary=True)}).rank == 4
    # a watchdog report is blamed only when nobody died
    hang = {0: Failure(0, 1.0, "collective all_reduce #3 ... rank(s) [1] did not arrive", hang=True)}
    assert isinstance(blame(hang), CollectiveTimeoutError)
    hang[1] = Failure(1, 2.0, "process exited with code 3 before returning", died=True)
    assert blame(hang).rank == 1


def test_connection_errors_are_secondary():
    try:
        try:
            raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer")
        except RuntimeError as e:
            raise CommError("all_reduce(algorithm=ring) on rank 0 failed") from e
    except CommError as e:
        assert is_secondary(e)
    assert not is_secondary(ValueError("boom"))


def _dies_in_the_middle(rank: int, victim: int, how: str) -> None:
    t = torch.ones(1 << 16)
    for step in range(40):
        if rank == victim and step == 20:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        comm.all_reduce(t, algorithm="ring")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how,victim", [("exit", 2), ("kill", 0), ("exit", 1)])
def test_spawn_names_the_rank_that_died_not_a_survivor(how, victim):
    with pytest.raises(RankFailedError) as ei:
        distrain.spawn(_dies_in_the_middle, 3, args=(victim, how), timeout=120)
    assert ei.value.rank == victim
    code = -signal.SIGKILL if how == "kill" else 3
    assert str(ei.value).startswith(f"rank {victim} failed:\nprocess exited with code {code} before returning")


# -- the CLI's flags for time-outs and resume --------------------------------------------------------

@pytest.mark.parametrize("flags,msg", [
    (["--timeout", "inf"], "--timeout must be a number of seconds >= 0 (0: no limit), got inf"),
    (["--timeout", "-1"], "--timeout must be a number of seconds >= 0 (0: no limit), got -1.0"),
    (["--collective-timeout", "0"], "--collective-timeout must be a positive number of seconds, got 0.0"),
    (["--collective-timeout", "nan"], "--collective-timeout must be a positive number of seconds, got nan"),
])
def test_bad_timeouts_are_one_line_errors(tmp_path, flags, msg, capsys):
    from distrain.cli import main

    assert main(["train", "--nproc", "1", "--strategy", "single", *TINY, "--out", str(tmp_path / "r"), *flags]) == 2
    err = capsys.readouterr().err
    assert err == f"distrain: error: {msg}\n"
    assert not (tmp_path / "r").exists()  # refused before the run folder is made


def test_resume_flag_values():
    from distrain.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["train", *a]).resume  # noqa: E731
    assert parse() is False and parse("--resume") is True and parse("--resume", "auto") == "auto"
    assert parse("--no-resume") is False and parse("--resume", "no") is False
    with pytest.raises(SystemExit):
        parse("--resume", "maybe")


# -- launch: `train` without `--`, `-- distrain train` ---------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", [["train"], ["--", "distrain", "train"]])
def test_launch_runs_train_with_or_without_double_dash(tmp_path, form):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "distrain.cli", "launch", "--nproc-per-node", "2", *form, "--nproc", "2",
                        *TINY, "--steps", "6", "--log-every", "1", "--out", str(out)],
                       env=_env(), capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == list(range(6))


# -- hangs: the collective watchdog names the ranks that did not arrive ------------------------------

def _one_rank_hangs(rank: int, victim: int, how: str) -> None:
    t = torch.ones(8)
    comm.all_reduce(t, algorithm="ring")  # everyone arrives once
    if rank == victim:
        if how == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        else:
            time.sleep(90)  # alive, but never calls the next collective in time
    comm.all_reduce(t, algorithm="ring")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how,victim,head,what,tail", [  # busy: at the time-out; stopped: from the heartbeats, early
    ("busy", 2, "collective time-out: rank ", "busy outside communication after 1 calls",
     "If a step legitimately takes longer, raise --collective-timeout (now 4s)"),
    ("stop", 1, "rank(s) not responding: rank ", "not responding (no heartbeat for",
     "Named from the heartbeats (every 0.25s), before --collective-timeout (now 4s)"),
])
def test_watchdog_names_the_hung_rank_and_the_flag(how, victim, head, what, tail):
    with pytest.raises(CollectiveTimeoutError) as ei:
        distrain.spawn(_one_rank_hangs, 3, args=(victim, how), timeout=150, init_timeout=4)
    msg = str(ei.value)
    assert msg.startswith(head) and "in all_reduce(algorithm=ring" in msg
    assert f"(seq 2 in its group, its call #2); 1 rank(s) did not arrive: rank {victim} {what}" in msg
    assert msg.endswith(tail)
    assert "\n" not in msg


@pytest.mark.timeout(240)
def test_train_with_a_stopped_rank_ends_with_one_line_naming_it(tmp_path):
    out = tmp_path / "run"
    p = _start("train", "--nproc", "2", *TINY, "--steps", "1000000", "--collective-timeout", "5", "--out", str(out))
    procs = _training(p, out, 2)
    ranks = sorted(q for c in _children(p.pid) for q in _children(c))  # top -> fork server -> ranks
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGSTOP)  # one rank frozen mid-training
    code, err = _finish(p, timeout=120)
    _no_orphans(procs)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("distrain: error: rank(s) not responding: rank "), err
    waiter, frozen = re.search(r"not responding: rank (\d) waited \d+\.\d\ds in .* \(seq \d+ in its group, its call #\d+\); "
                               r"1 rank\(s\) did not arrive: rank (\d) not responding \(no heartbeat for", lines[0]).groups()
    assert {waiter, frozen} == {"0", "1"} and lines[0].endswith("before --collective-timeout (now 5s)")


# -- checkpoints and resume: checked, checksummed, torn files are one-line errors ----------------------

def _job(out, **kw):
    from distrain.trainer import TrainConfig

    base = dict(model="mlp-tiny", data="digits", strategy="single", nproc=1, steps=3, batch_size=16, lr=1e-2,
                optimizer="sgd", eval_every=0, sample_chars=0, progress=False, report=False, log_every=1,
                out=str(out), timeout=120)
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A committed 3-step checkpoint to resume from (copied per test)."""
    from distrain.trainer import train

    out = tmp_path_factory.mktemp("trained") / "run"
    train(_job(out))
    return out


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("field,value,shown", [
    ("seed", 1, "--seed is 1 but the checkpoint"), ("batch_size", 32, "--batch-size is 32 but"),
    ("dtype", "float64", "--dtype is 'float64' but"), ("optimizer", "adamw", "--optimizer is 'adamw' but"),
    ("lr", 0.5, "--lr is 0.5 but"),
])
def test_resume_refuses_a_change_that_breaks_exact_continuation(trained, tmp_path, field, value, shown):
    from distrain.trainer import train

    out = _copy(trained, tmp_path / "run")
    with pytest.raises(ConfigError) as ei:
        train(_job(out, steps=6, resume=True, **{field: value}))
    msg = str(ei.value)
    assert msg.startswith(f"--resume: {shown}") and "\n" not in msg
    assert msg.endswith("breaks exact continuation: resume with the same value or choose another --out")


@pytest.mark.timeout(120)
def test_corrupt_empty_or_torn_checkpoint_files_are_one_line_errors(trained, tmp_path):
    from distrain import checkpoint
    from distrain.trainer import train

    out = _copy(trained, tmp_path / "flip")
    shard = out / json.loads((out / "checkpoint.json").read_text())["files"][0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of one byte
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=rf"^--resume: {re.escape(str(shard))} does not match the checksum in "
                                          rf"checkpoint.json \(the file was corrupted or changed"):
        train(_job(out, steps=6, resume=True))

    out = _copy(trained, tmp_path / "empty")
    shard = out / shard.name
    shard.write_bytes(b"")
    with pytest.raises(ConfigError, match=rf"^--resume: checkpoint {re.escape(str(shard))} is empty \(0 bytes\)"):
        train(_job(out, steps=6, resume=True))
    with pytest.raises(ConfigError, match=rf"^checkpoint {re.escape(str(shard))} is empty \(0 bytes\)"):
        checkpoint.load(shard)
    shard.write_bytes(b"PK\x03\x04 torn")  # a torn zip without a manifest checksum to catch it
    with pytest.raises(ConfigError, match=rf"^checkpoint {re.escape(str(shard))} is corrupt or truncated") as ei:
        checkpoint.load(shard)
    assert "\n" not in str(ei.value)

    out = _copy(trained, tmp_path / "torn")
    text = (out / "checkpoint.json").read_text()
    (out / "checkpoint.json").write_text(text[: len(text) // 2])
    with pytest.raises(ConfigError, match=r"^--resume: .*checkpoint.json is corrupt \(") as ei:
        train(_job(out, steps=6, resume=True))
    assert "\n" not in str(ei.value)


@pytest.mark.timeout(180)
def test_a_torn_last_metrics_line_does_not_block_resume_and_resume_auto(trained, tmp_path):
    from distrain.trainer import train
    from distrain.trainer.metrics import read_metrics

    out = _copy(trained, tmp_path / "run")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.2')  # killed mid-line
    train(_job(out, steps=5, resume="auto"))
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 5
    fresh = tmp_path / "fresh"
    train(_job(fresh, steps=2, resume="auto"))  # auto without a checkpoint: starts at step 0
    assert [r["step"] for r in read_metrics(fresh / "metrics.jsonl")] == [0, 1]


@pytest.mark.timeout(120)
def test_cli_cleans_temporaries_a_killed_save_left(trained, tmp_path, capsys):
    from distrain.cli import main

    out = _copy(trained, tmp_path / "run")
    (out / ".checkpoint-00000004-tp0-pp0.pt.x1y2.tmp").write_bytes(b"half a checkpoint")
    (out / ".checkpoint.json.z9.tmp").write_bytes(b"{")
    args = ["train", "--strategy", "single", "--nproc", "1", *TINY, "--optimizer", "sgd", "--lr", "0.01",
            "--batch-size", "16", "--sample-chars", "0", "--log-every", "1", "--steps", "4", "--resume", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.glob(".*.tmp")) == []
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 4


# -- bad numbers --------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,msg", [
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--momentum", "1.5"], "--momentum must be in [0, 1), got 1.5"),
    (["--weight-decay=-inf"], "--weight-decay must be a finite number >= 0, got -inf"),
    (["--eval-every", "5", "--eval-batches", "0"],
     "--eval-batches must be >= 1 when evaluating, got 0 (use --eval-every 0 to skip evaluation)"),
])
def test_bad_numbers_are_one_line_errors(tmp_path, flags, msg, capsys):
    from distrain.cli import main

    assert main(["train", "--nproc", "1", "--strategy", "single", *TINY, "--out", str(tmp_path / "r"), *flags]) == 2
    assert capsys.readouterr().err == f"distrain: error: {msg}\n"


@pytest.mark.timeout(120)
def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    from distrain.trainer import train

    out = tmp_path / "run"
    # sgd at lr 1e8: the loss overflows at step 1 and is NaN at step 2
    with pytest.raises(RankFailedError) as ei:
        train(_job(out, steps=12, lr=1e8, ckpt_every=2))
    assert str(ei.value) == ("rank 0 failed: TrainingError: step 2: the loss is nan; the run stops before writing it "
                             "or a checkpoint (the last good checkpoint stays in --out): lower --lr, use --dtype "
                             "float64, or check the data")
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]  # valid JSON throughout
    assert [r["step"] for r in rows] == [0, 1]
    assert json.loads((out / "checkpoint.json").read_text())["step"] == 2
    assert sorted(p.name for p in out.glob("checkpoint-*.pt")) == ["checkpoint-00000002-tp0-pp0.pt"]


# -- elastic restarts resume from the newest checkpoint ---------------------------------------------

def _rank_pids(top: int) -> dict[int, int]:
    """rank -> pid of the ranks torchrun started under ``top`` (their environment holds RANK)."""
    found = {}
    for pid in descendants(top):
        try:
            env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and env.get("DISTRAIN_PARENT_PID") == str(top):
            found[int(env["RANK"])] = pid
    return found


@pytest.mark.timeout(600)
def test_launch_max_restarts_resumes_after_a_killed_rank_with_the_same_losses(tmp_path):
    from distrain.cli import main
    from distrain.trainer.metrics import read_metrics

    # the first checkpoint at step 25 leaves 575 steps (over a second at the quickest pace seen, 2 ms a step) for a
    # 0.1 s poll to find it and kill a rank mid-run
    steps, every = 600, 25
    job = [*TINY, "--optimizer", "sgd", "--lr", "0.05", "--batch-size", "16", "--steps", str(steps), "--ckpt-every",
           str(every), "--log-every", "50"]
    ref = tmp_path / "ref"
    # (the reference from this process: the same `distrain train --nproc 2`, its ranks forked from the same fork
    # server, without a fresh interpreter's seconds of imports)
    assert main(["train", "--nproc", "2", *job, "--out", str(ref)]) == 0
    out = tmp_path / "run"
    # one kill, one restart: a launched rank used to abort at exit now and then ("terminate called without an active
    # exception", exit -6, so 2 restarts were allowed), fixed by runtime.init's exit hook (see runtime.py)
    p = _start("launch", "--max-restarts", "1", "--nproc-per-node", "2", "train", *job, "--out", str(out))
    _wait_for(lambda: (out / "checkpoint.json").exists(), 240, "the first checkpoint", p)
    ranks = _rank_pids(p.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], signal.SIGKILL)
    killed_at = json.loads((out / "checkpoint.json").read_text())["step"]
    code, err = _finish(p, timeout=280)
    assert code == 0, err
    assert every <= killed_at < steps  # the kill came mid-run, after a checkpoint: the restart resumed from it
    got, want = read_metrics(out / "metrics.jsonl"), read_metrics(ref / "metrics.jsonl")
    assert [g["step"] for g in got] == list(range(steps))
    assert [g["loss"] for g in got] == [w["loss"] for w in want]  # bit-identical to the uninterrupted run


# -- long randomized trials (pytest -m faults_long): SIGKILL a random rank at a random moment, resume --------

LONG_JOBS = {
    "ddp": ["--nproc", "3", *TINY, "--batch-size", "24", "--steps", "400", "--ckpt-every", "20", "--log-every", "10"],
    "tp2xpp2": ["--nproc", "4", "--model", "gpt-tiny", "--data", "shakespeare", "--tp", "2", "--pp", "2",
                "--microbatches", "2", "--batch-size", "8", "--steps", "60", "--ckpt-every", "5", "--log-every", "5",
                "--no-progress", "--eval-every", "0", "--no-report", "--sample-chars", "0"],
}
TRIALS = int(os.environ.get("DISTRAIN_FAULT_TRIALS", "5"))


@pytest.mark.faults_long
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("job", sorted(LONG_JOBS))
def test_random_sigkill_of_a_rank_then_resume_is_bit_identical(tmp_path, job):
    import random

    from distrain.trainer.metrics import read_metrics

    args = LONG_JOBS[job]
    ref = tmp_path / "ref"
    r = subprocess.run([sys.executable, "-m", "distrain.cli", "train", *args, "--out", str(ref)], env=_env(),
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    want = [w["loss"] for w in read_metrics(ref / "metrics.jsonl")]
    rng = random.Random(int(os.environ.get("DISTRAIN_FAULT_SEED", "0")))
    outcomes = []
    for trial in range(TRIALS):
        out = tmp_path / f"t{trial}"
        p = _start("train", *args, "--out", str(out))
        _wait_for(lambda: _metric_lines(out) >= 1, 300, "the first metrics line", p)
        time.sleep(rng.uniform(0.0, 3.0))
        ranks = [q for c in _children(p.pid) for q in _children(c)]
        if p.poll() is not None or not ranks:
            outcomes.append("finished before the kill")
            continue
        os.kill(rng.choice(ranks), signal.SIGKILL)
        code, err = _finish(p, timeout=120)
        assert code == 2 and "process exited with code -9 before returning" in err, err  # the dead rank is named
        _no_orphans(descendants(p.pid))
        resumed = subprocess.run([sys.executable, "-m", "distrain.cli", "train", *args, "--resume", "auto",
                                  "--out", str(out)], env=_env(), capture_output=True, text=True, timeout=900)
        assert resumed.returncode == 0, resumed.stderr
        got = [g["loss"] for g in read_metrics(out / "metrics.jsonl")]
        outcomes.append("identical" if got == want else "DIFFERENT")
        assert not list(out.glob(".*.tmp"))
    print(f"\n{job}: {TRIALS} random SIGKILLs -> {outcomes}")
    assert all(o in ("identical", "finished before the kill") for o in outcomes), outcomes
