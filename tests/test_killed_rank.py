"""A rank of a fixed (non-elastic) job killed mid-run: one typed line that names the signal, what usually
sends it, the checkpoint there is and how to go on; and every rank carries its title in ``ps``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import descendants
from distrain import checkpoint
from distrain.errors import RankKilledError

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--model", "mlp-tiny", "--data", "digits", "--no-progress", "--eval-every", "0", "--no-report",
        "--steps", "1000000", "--log-every", "1"]
OOM = "SIGKILL, usually the kernel's OOM killer when the host runs out of memory (`dmesg` says so), or `kill -9`"


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def _ranks(pid: int) -> dict[str, int]:
    """The processes under ``pid`` by their kernel name (/proc/PID/comm)."""
    return {_read(f"/proc/{q}/comm"): q for q in descendants(pid)}


def _kill_rank_1(tmp_path: Path, *flags: str) -> tuple[str, dict[int, str], Path]:
    """Start a 2-rank job, SIGKILL its rank 1 once it trains, return (its stderr, the ranks' command lines, --out)."""
    out = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "DISTRAIN_PARENT_PID")}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.Popen([sys.executable, "-m", "distrain.cli", "train", "--nproc", "2", "--strategy", "ddp", *TINY,
                          "--out", str(out), *flags], env=env, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 150
        while not (out / "metrics.jsonl").exists() or len((out / "metrics.jsonl").read_text().splitlines()) < 5:
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read() if p.poll() is not None else ""
            time.sleep(0.1)
        ranks = _ranks(p.pid)
        assert {"distrain rank 0", "distrain rank 1"} <= set(ranks), ranks  # prctl: /proc/PID/comm, 15 bytes
        cmdlines = {r: _read(f"/proc/{ranks[f'distrain rank {r}']}/cmdline") for r in (0, 1)}
        os.kill(ranks["distrain rank 1"], signal.SIGKILL)
        _, err = p.communicate(timeout=90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 2, err
    return err, cmdlines, out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_rank_without_a_checkpoint_names_the_signal_and_the_flags(tmp_path):
    err, cmdlines, out = _kill_rank_1(tmp_path)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines[-1] == (
        f"distrain: error: rank 1 failed: killed by {OOM}; the job stopped; no checkpoint was written (--ckpt-every 0 "
        f"writes one only at the end), so the run's work is lost: rerun with --ckpt-every N to keep a checkpoint every "
        f"N steps (--resume goes on from it), or with --elastic MIN:MAX to keep a job going when a rank is lost"), err
    assert "collective mismatch" not in err
    try:
        import setproctitle  # noqa: F401 - a dependency: the full title in the command line
    except ImportError:
        return
    assert cmdlines == {0: "distrain rank 0/2", 1: "distrain rank 1/2"}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_killed_rank_with_a_checkpoint_names_its_step_and_resume(tmp_path):
    err, _, out = _kill_rank_1(tmp_path, "--ckpt-every", "2")
    last = [ln for ln in err.splitlines() if ln.strip()][-1]
    m = re.fullmatch(rf"distrain: error: rank 1 failed: killed by {re.escape(OOM)}; the job stopped; the checkpoint "
                     rf"of step (\d+) is in {re.escape(str(out))}: rerun the same command with --resume to go on from "
                     rf"it, or with --elastic MIN:MAX to keep a job going when a rank is lost", last)
    assert m is not None, err
    assert int(m[1]) == checkpoint.read_manifest(out)["step"] >= 2


def test_the_signal_decides_the_cause_and_the_error_type():
    from distrain.blame import Failure, blame
    from distrain.launch.supervisor import died_message, signal_cause

    err = blame({1: Failure(1, 1.0, died_message(-15), died=True, exitcode=-15),
                 0: Failure(0, 0.5, "CommError: reset", secondary=True)})
    assert isinstance(err, RankKilledError) and (err.rank, err.signal) == (1, signal.SIGTERM)
    assert str(err) == ("rank 1 failed:\nprocess exited with code -15 before returning (killed by SIGTERM, usually an "
                        "operator (`kill`) or a job scheduler ending the job)")
    assert signal_cause(2) == "SIGINT, usually an operator (Ctrl-C)"
    assert signal_cause(6).startswith("SIGABRT; if the backend aborted, its message is on stderr above: a collective "
                                      "mismatch")
    exited = blame({1: Failure(1, 1.0, died_message(3), died=True, exitcode=3)})
    assert type(exited) is not RankKilledError and exited.rank == 1


def test_a_lost_peer_under_a_checkpoints_bookkeeping_is_blamed_as_secondary(monkeypatch):
    """CI once blamed rank 0 for rank 1's SIGKILL: rank 0's checkpoint all_gather (torch's own, called directly)
    raised Gloo's bare RuntimeError, a primary failure stamped before the parent saw rank 1 die. Under
    transport_errors it is a PeerLostError, secondary by type, and the killed rank is blamed."""
    import torch

    from distrain.blame import is_secondary
    from distrain.comm import objects
    from distrain.errors import PeerLostError

    def reset(*args, **kwargs):
        raise RuntimeError("Read error: Connection reset by peer")

    monkeypatch.setattr(objects.dist, "all_gather", reset)
    with pytest.raises(PeerLostError) as got:
        objects._all_gather([torch.empty(1)], torch.zeros(1), None, None)  # (all_gather_data's torch path)
    assert is_secondary(got.value)
