"""What a new user meets with their own model, folder and terminal (issue 42): every model name the
unknown-model error offers trains or is refused in one line; a factory importable from the current
folder; nothing half-written after a failure; logs without a terminal; one step numbering."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distrain.errors import ConfigError
from distrain.models import list_models
from distrain.models.registry import SHAPE_ONLY_PRESETS
from distrain.trainer import TrainConfig
from distrain.trainer.choices import MODEL_DATA

ROOT = Path(__file__).resolve().parents[1]
# pip's console script for `distrain` (pyproject's [project.scripts]): run as a file, so its sys.path[0] is its
# own bin folder, not the current one (python -m puts the current folder there)
CONSOLE_SCRIPT = "import sys\nfrom distrain.cli import run_command\nif __name__ == '__main__':\n    sys.exit(run_command())\n"
NETS = "import torch.nn as nn\n\n\ndef make_net():\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n"
TINY = ["--data", "digits", "--steps", "3", "--batch-size", "8", "--eval-every", "0", "--no-progress", "--no-report"]


def _distrain(args, cwd: Path, bin_dir: Path, timeout: float = 100) -> subprocess.CompletedProcess:
    """The ``distrain`` console script, run in ``cwd`` with only distrain's sources on PYTHONPATH."""
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "distrain"
    script.write_text(CONSOLE_SCRIPT)
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _mypkg(folder: Path) -> Path:
    (folder / "mypkg").mkdir(parents=True)
    (folder / "mypkg" / "__init__.py").write_text("")
    (folder / "mypkg" / "nets.py").write_text(NETS)
    return folder


def _offered_models() -> list[str]:
    """The model names the unknown-model error offers, read from its message."""
    with pytest.raises(ConfigError) as e:
        TrainConfig(model="no-such-model").validate()
    msg = str(e.value)
    assert "\n" not in msg
    # each name of a list: after "of ", ", " or ": ", before "," or ")"
    offered = re.findall(r"(?:(?<=of )|(?<=, )|(?<=: ))[\w.-]+(?=[,)])", msg.split("unknown; ", 1)[1])
    assert set(offered) == set(list_models()), msg  # every name offered, and only names
    return offered


def test_every_model_the_error_offers_trains_or_is_refused_in_one_line(tmp_path):
    for name in _offered_models():
        cfg = TrainConfig(model=name, data={"text": "shakespeare"}.get(MODEL_DATA.get(name, "text"), MODEL_DATA.get(name)), steps=2, batch_size=4,
                          out=str(tmp_path / "run"))
        if name in SHAPE_ONLY_PRESETS:
            with pytest.raises(ConfigError) as e:
                cfg.validate(fashion_mnist_root=str(tmp_path))
            assert str(e.value) == (
                f"--model {name} is a shape-only preset: its published sizes, for `distrain plan` and the cost model "
                f"(no weights, and too large to train from scratch here); to train the real model, download its "
                f"Hugging Face folder and give --init-from DIR (docs/llama.md)")
        else:  # a trainable preset with its kind of data: valid (fashion-mnist's folder: tmp_path stands in)
            assert cfg.validate(fashion_mnist_root=str(tmp_path)) is cfg


@pytest.mark.slow  # a fresh interpreter and 2 ranks: 10-20 s on 2 shared cores
@pytest.mark.timeout(180)
def test_console_script_imports_a_factory_from_the_current_folder(tmp_path):
    here = _mypkg(tmp_path / "project")
    p = _distrain(["train", "--model", "mypkg.nets:make_net", "--nproc", "2", "--out", "run", *TINY], here,
                  tmp_path / "bin")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (here / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3  # both ranks imported mypkg from the current folder and trained the 3 steps
    assert json.loads((here / "run" / "config.json").read_text())["model"] == "mypkg.nets:make_net"


@pytest.mark.slow  # a fresh interpreter: 3-6 s
@pytest.mark.timeout(60)
def test_a_missing_factory_module_is_refused_before_any_rank(tmp_path):
    here = _mypkg(tmp_path / "project")
    p = _distrain(["train", "--model", "mypkg.nope:make_net", "--nproc", "2", "--out", "run", *TINY], here,
                  tmp_path / "bin")
    assert p.returncode == 2
    assert p.stderr == ("distrain: error: --model mypkg.nope:make_net: cannot import mypkg.nope (No module named "
                        "'mypkg.nope'); is it on PYTHONPATH?\n")  # one line, from the top process, no rank's
    assert sorted(x.name for x in here.iterdir()) == ["mypkg"]  # no --out made: refused before the run started


# -- nothing half-written ------------------------------------------------------------------------------------------
BROKEN = "def make_net():\n    raise RuntimeError('the factory broke')\n"
SINGLE = ["--strategy", "single", "--nproc", "1", "--data", "digits", "--steps", "2", "--batch-size", "8",
          "--eval-every", "0", "--no-progress", "--no-report"]


@pytest.mark.slow  # three one-rank runs: 10-20 s on 2 shared cores
@pytest.mark.timeout(150)
def test_failed_runs_leave_no_folder_and_finished_runs_no_lock(tmp_path, monkeypatch, capsys):
    from distrain.cli import main
    from distrain.runlock import LOCK_NAME

    (tmp_path / "brokennets.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}:{ROOT / 'src'}")
    # a run that fails in its rank before its first step: the folder it created (and the parent) is gone
    new = tmp_path / "runs" / "broken"
    assert main(["train", "--model", "brokennets:make_net", "--out", str(new), *SINGLE]) == 2
    assert "the factory broke" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    # the same failure in a folder that was there: the folder stays, without a lock file
    there = tmp_path / "there"
    there.mkdir()
    assert main(["train", "--model", "brokennets:make_net", "--out", str(there), *SINGLE]) == 2
    assert "the factory broke" in capsys.readouterr().err
    assert list(there.iterdir()) == []
    # --resume on a folder that does not exist: refused, nothing created
    missing = tmp_path / "missing" / "run"
    assert main(["train", "--resume", "--model", "mlp-tiny", "--out", str(missing), *SINGLE]) == 2
    assert capsys.readouterr().err == (f"distrain: error: --resume: checkpoint {missing}/checkpoint.json does not "
                                       f"exist; run without --resume to start afresh\n")
    assert not (tmp_path / "missing").exists()
    # a run that finishes: its results, and no stale lock
    ok = tmp_path / "ok"
    assert main(["train", "--model", "mlp-tiny", "--out", str(ok), *SINGLE]) == 0
    held = sorted(p.name for p in ok.iterdir())
    assert LOCK_NAME not in held and "checkpoint.json" in held and "metrics.jsonl" in held


@pytest.mark.slow  # the cheapest self-test (ddp over Gloo against one process): 10-30 s on 2 shared cores
@pytest.mark.timeout(170)
def test_selftest_leaves_nothing_unless_kept(tmp_path, monkeypatch, capsys):
    import tempfile

    from distrain.cli import main

    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    tmp.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))  # where its temporary folder goes
    assert main(["selftest", "--only", "ddp", "--transports", "gloo"]) == 0
    out = capsys.readouterr().out
    assert "ddp" in out and "selftest.json" not in out  # the table, and no file named
    assert list(work.iterdir()) == [] and list(tmp.iterdir()) == []  # no runs/selftest, no temporary folder left
    assert main(["selftest", "--only", "ddp", "--out", "runs/st"]) == 2  # --out does nothing without --keep
    assert capsys.readouterr().err == ("distrain: error: --out runs/st: the self-test keeps its runs only with --keep "
                                       "(without it, it works in a temporary folder and leaves nothing); add --keep\n")
    assert list(work.iterdir()) == []


# -- logs without a terminal; one step numbering ---------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter and a one-rank run: 5-15 s on 2 shared cores
@pytest.mark.timeout(100)
def test_no_progress_prints_plain_lines_numbered_as_metrics_and_checkpoints(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "distrain", "train", "--model", "gpt-tiny", "--strategy", "single",
                        "--nproc", "1", "--steps", "6", "--batch-size", "4", "--log-every", "2", "--eval-every", "3",
                        "--eval-batches", "1", "--ckpt-every", "3", "--sample-chars", "0", "--no-progress", "--out",
                        str(out)], cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
                       capture_output=True, text=True, timeout=90)  # stdout a pipe: no terminal
    assert p.returncode == 0, p.stderr[-2000:]
    assert "\r" not in p.stdout + p.stderr
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2, 3, 4, 5]
    lines = p.stdout.splitlines()
    step_lines = [re.fullmatch(r"single/gpt-tiny step (\d+): loss ([\d.]+), tokens/s [\d,]+ \((\d+)/6 steps done\)", ln)
                  for ln in lines if ln.startswith("single/")]
    val_lines = [re.fullmatch(r"step (\d+): validation loss ([\d.]+)", ln) for ln in lines if ln.startswith("step ")]
    assert all(step_lines) and all(val_lines), p.stdout
    assert lines.index("") == len(step_lines) + len(val_lines)  # those lines first, then the summary table
    # a line every --log-every steps, and before the evaluation and checkpoint after step 2 (the 3rd), and at the end
    assert [int(m[1]) for m in step_lines] == [1, 2, 4, 5]
    assert [int(m[3]) for m in step_lines] == [2, 3, 5, 6]
    for m in step_lines:  # the console's step k is metrics.jsonl's step k
        assert m[2] == f"{rows[int(m[1])]['loss']:.4f}"
    assert [int(m[1]) for m in val_lines] == [k for k in sorted(rows) if "val_loss" in rows[k]] == [2, 5]
    for m in val_lines:
        assert m[2] == f"{rows[int(m[1])]['val_loss']:.4f}"
    # the checkpoint is named by the step boundary it holds: after steps 0..5, step 6, where --resume goes on
    manifest = json.loads((out / "checkpoint.json").read_text())
    assert manifest["step"] == max(rows) + 1 == 6
    assert manifest["files"] == ["checkpoint-00000006-tp0-pp0.pt"]
