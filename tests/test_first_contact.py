"""What a new user meets first: the README example, spawn's start-up errors, the CLI's help,
--version, python -m distrain, a protected run folder, --device."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distrain.cli import build_parser, main
from distrain.errors import ConfigError
from distrain.trainer import TrainConfig, train

from conftest import trainer_config

ROOT = Path(__file__).resolve().parents[1]


def _python(args, cwd, timeout=120) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a fresh interpreter and fork server: 6-8 s
@pytest.mark.timeout(100)
def test_readme_example_runs_as_written(tmp_path):
    code = re.search(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    (tmp_path / "example.py").write_text(code)
    p = _python(["example.py"], tmp_path, timeout=90)
    assert p.returncode == 0, p.stderr[-2000:]
    # ddp on 2 ranks learns the rule of the example's data: the held-out loss and accuracy it prints
    loss, accuracy = map(float, p.stdout.strip().splitlines()[-1].split())
    assert loss < 0.2 and accuracy > 0.9, p.stdout[-2000:]  # seeded: 0.069 and 0.969 here


@pytest.mark.slow  # a fresh interpreter and fork server: 6-8 s
@pytest.mark.timeout(100)
def test_spawn_names_the_missing_main_guard(tmp_path):
    (tmp_path / "noguard.py").write_text(
        "import distrain\n\ndef work(rank):\n    return rank\n\nprint(distrain.spawn(work, nprocs=2))\n")
    p = _python(["noguard.py"], tmp_path, timeout=90)
    assert p.returncode == 1
    last = p.stderr.strip().splitlines()[-1]
    assert last == (f"process exited with code 1 while starting: {tmp_path / 'noguard.py'} has no `if __name__ == "
                    f"\"__main__\":` guard, so each new rank re-ran the script's top level (and its spawn call) on "
                    f"import. Put the code that calls distrain.spawn under `if __name__ == \"__main__\":` and keep "
                    f"work() at module level")


@pytest.mark.slow  # a fresh interpreter and fork server: 6-8 s
@pytest.mark.timeout(100)
def test_spawn_names_a_function_the_ranks_cannot_import(tmp_path):
    (tmp_path / "inner.py").write_text(
        "import distrain\n\nif __name__ == '__main__':\n    def work(rank):\n        return rank\n\n"
        "    print(distrain.spawn(work, nprocs=2))\n")
    p = _python(["inner.py"], tmp_path, timeout=90)
    assert p.returncode == 1
    assert ("while starting, before any rank joined the process group (its traceback is on stderr above). Usual "
            "causes: work is not importable by name (define it at module level") in p.stderr


def test_every_train_flag_has_help_default_and_choices():
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    train_parser = sub.choices["train"]
    actions: dict = {}
    for a in train_parser._actions:  # the first flag of each field (--resume before --no-resume)
        actions.setdefault(a.dest, a)
    flat = "".join(train_parser.format_help().split())  # help wraps lines (also at hyphens)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        a = actions[f.name]
        # --model alone is resolved at start (None on the command line): gpt-small, or under
        # --init-from / --resume the checkpoint's model, and its help says so
        resolved = f.name == "model"
        assert flag in a.option_strings and a.default == (None if resolved else f.default)
        assert f.metadata.get("help") and a.help.startswith(f.metadata["help"]), f"{flag}: no help from the field"
        expanded = a.help % {"default": a.default}
        tail = "; with --init-from or --resume: the checkpoint's model)" if resolved else ")"
        assert expanded.endswith(f"(default: {f.default}{tail}"), expanded
        assert "".join(expanded.split()) in flat, f"{flag}: its help is not shown"
        for c in f.metadata.get("choices") or ():
            assert str(c) in expanded, f"{flag}: allowed value {c} not listed"


def test_version_and_python_m(tmp_path, capsys):
    from distrain import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"distrain {__version__}"
    p = _python(["-m", "distrain", "--version"], tmp_path, timeout=60)
    assert (p.returncode, p.stdout.strip()) == (0, f"distrain {__version__}")


@pytest.mark.slow
def test_commands_that_need_no_torch_do_not_import_it(tmp_path):
    """`distrain --version`, `distrain cluster up|down|status|link` and `distrain data prepare` import no torch (about 1.7 s of CPU per
    process on the 2-core host): main builds only the parser of the command it runs, and the package's
    torch-backed names are imported on use. A train command's parser still imports it (the check can fail)."""
    code = ("import sys\nfrom distrain.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    for argv, want in [(["--version"], "False"), (["cluster", "status", "--name", "zz-none"], "False"),
                       (["cluster", "link", "--help"], "False"),
                       (["data", "prepare", "no.txt", "--tokenizer", "byte", "--out", "o"], "False"),
                       (["train", "--help"], "True")]:
        p = _python(["-c", code, *argv], tmp_path, timeout=60)
        assert p.stdout.strip().splitlines()[-1] == want, f"distrain {' '.join(argv)}: {p.stdout}{p.stderr}"


def test_a_previous_run_is_not_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    (out / "notes.txt").write_text("mine")
    cfg = dict(strategy="single", nproc=1, model="mlp-tiny", data="digits", steps=2, batch_size=8)
    with pytest.raises(ConfigError, match=r"^--out .*run is not empty \(metrics\.jsonl, notes\.txt\); pass --resume "
                                          r"to continue that run, --overwrite to replace it, or choose another --out$"):
        train(trainer_config(out, **cfg))
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "loss": 1.0}\n'
    assert main(["train", "--strategy", "single", "--nproc", "1", "--model", "mlp-tiny", "--data", "digits",
                 "--out", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    train(trainer_config(out, overwrite=True, **cfg))  # replaces the run's own files, keeps the user's
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert (out / "notes.txt").read_text() == "mine"


def test_device_flag():
    with pytest.raises(ConfigError, match=r"--device 'tpu' is unknown; use one of auto, cpu, cuda"):
        trainer_config("x", device="tpu").validate()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"--device cuda: no CUDA device is visible"):
            trainer_config("x", device="cuda").validate()


@pytest.mark.timeout(90)
def test_device_cpu_moves_model_and_batches(tmp_path):
    # the same code path a GPU run takes (model.to(device), batches to the device), on the CPU
    summary = train(trainer_config(tmp_path / "cpu", strategy="ddp", nproc=2, device="cpu", model="mlp-tiny",
                                   data="digits", steps=2, batch_size=8))
    assert summary["label"] == "ddp (ring)" and summary["steps"] == 2
