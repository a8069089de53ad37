"""``distrain checkpoint import`` of what users have: a plain ``torch.save(model.state_dict())``
file or a ``.safetensors`` file (weights alone: step 0, a fresh optimizer from the config), and
what ``consolidate`` writes; wrong input is a one-line error that leaves ``--out`` as it was.
``checkpoint consolidate`` names itself in its errors, where ``--resume`` keeps its own."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file, save_model

import distrain
from distrain import runlock
from distrain.cli import main as cli_main
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.checkpoint import store as checkpoint
from distrain.trainer import train
from distrain.checkpoint.write import import_file
from distrain.trainer.run_folder import check_resume
from distrain.trainer.metrics import read_metrics

from conftest import trainer_config

STEPS = 3
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}  # trainer_config's AdamW


def _weights(seed: int = 7, preset: str = "gpt-tiny") -> dict[str, torch.Tensor]:
    """A model's weights as a user saves them (float32; not the trainer's seed-0 initialisation)."""
    torch.manual_seed(seed)
    return build_model(preset).state_dict()


def _import(*args) -> int:
    return cli_main(["checkpoint", "import", *map(str, args)])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err.removeprefix("distrain: error: ").rstrip("\n")


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _shard(out) -> dict:
    manifest = json.loads((out / checkpoint.MANIFEST).read_text())
    return torch.load(out / manifest["files"][0], weights_only=True)


_REFERENCE: dict = {}


def _reference(tmp_path_factory):
    """The same job started from those weights (the model handed to distrain.train): losses and
    final weights, computed once."""
    if not _REFERENCE:
        out = tmp_path_factory.mktemp("from-weights")
        model = build_model("gpt-tiny")
        model.load_state_dict(_weights())
        distrain.train(model=model, config=trainer_config(out, strategy="single", nproc=1, steps=STEPS))
        _REFERENCE.update(losses=_losses(out), final=_shard(out))
    return _REFERENCE


@pytest.mark.timeout(110)
@pytest.mark.parametrize("fmt", ["pt", "safetensors"])
def test_weights_alone_import_bitwise_and_train_from_them(tmp_path, tmp_path_factory, capsys, fmt):
    weights = _weights()
    src = tmp_path / f"weights.{fmt}"
    if fmt == "pt":
        torch.save(weights, src)
    else:
        save_file(weights, src)
    out = tmp_path / "run"
    assert _import(src, "--out", out, "--model", "gpt-tiny") == 0
    assert capsys.readouterr().out == (
        f"{out}: checkpoint at step 0; the optimizer starts fresh: adamw, weight decay 0.0 (train with the same); "
        f"continue it with `distrain train --out {out} --resume --reshard --model gpt-tiny ...` in any layout\n")
    manifest = json.loads((out / checkpoint.MANIFEST).read_text())
    assert (manifest["step"], manifest["layout"], manifest["model"]) == (0, {"consolidated": True}, "gpt-tiny")
    assert manifest["config"] == {"optimizer": "adamw", "weight_decay": 0.0}
    ck = _shard(out)
    assert list(ck["model"]) == list(weights)
    for name, t in weights.items():  # bit for bit, in the file's dtype
        assert ck["model"][name].dtype == t.dtype and torch.equal(ck["model"][name], t), name
    assert ck["optimizer"]["state"] == {}
    [group] = ck["optimizer"]["param_groups"]
    assert group["betas"] == (0.9, 0.999) and group["weight_decay"] == 0.0

    # the run trains from them with a fresh AdamW: exactly the job that starts from those weights
    train(trainer_config(out, strategy="single", nproc=1, steps=STEPS, resume=True, reshard=True))
    ref = _reference(tmp_path_factory)
    assert _losses(out) == ref["losses"]
    final = _shard(out)
    for name, t in ref["final"]["model"].items():
        assert torch.equal(final["model"][name], t), name
    [group] = final["optimizer"]["param_groups"]
    assert {k: group[k] for k in ADAMW} == ADAMW
    assert {float(s["step"]) for s in final["optimizer"]["state"].values()} == {float(STEPS)}  # from 0, not on

    # --resume holds the run to the optimizer the checkpoint was given
    with pytest.raises(ConfigError, match=r"^--resume: --weight-decay is 0\.1 but the checkpoint .*checkpoint\.json "
                                          r"was trained with 0\.0; a changed weight_decay breaks exact continuation"):
        train(trainer_config(out, strategy="single", nproc=1, steps=STEPS + 1, resume=True, reshard=True,
                             weight_decay=0.1))


@pytest.mark.timeout(110)
def test_consolidated_file_without_hyperparameters_gets_a_fresh_optimizer(tmp_path, capsys):
    """The new user's KeyError: 'betas': a consolidated file whose optimizer has no hyperparameters
    keeps its weights and step; the optimizer starts fresh, from the config."""
    form = {"kind": "distrain.full/1", "step": 1, "model": _weights(),
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.01}]},
            "run": {"model": "gpt-tiny", "strategy": "single", "layout": {"dp": 1, "tp": 1, "pp": 1}, "config": {}}}
    checkpoint.save(tmp_path / "old.pt", form)
    out = tmp_path / "run"
    assert _import(tmp_path / "old.pt", "--out", out) == 0
    assert "checkpoint at step 1; the optimizer starts fresh: adamw, weight decay 0.0" in capsys.readouterr().out
    [group] = _shard(out)["optimizer"]["param_groups"]
    assert group["betas"] == (0.9, 0.999)
    train(trainer_config(out, strategy="single", nproc=1, steps=2, resume=True, reshard=True))
    assert len(_losses(out)) == 1
    assert float(next(iter(_shard(out)["optimizer"]["state"].values()))["step"]) == 1  # one step, fresh


def test_a_consolidated_file_keeps_its_optimizer(tmp_path):
    opt_state = {"exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3), "step": torch.tensor(4.0)}
    groups = [{k: v for k, v in g.items() if k != "params"}
              for g in torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=0.5).state_dict()["param_groups"]]
    form = {"kind": "distrain.full/1", "step": 4, "model": _weights(),
            "optimizer": {"state": {"layers.1.ln_1.bias": opt_state}, "param_groups": groups},
            "run": {"model": "gpt-tiny", "strategy": "ddp", "layout": {"dp": 2, "tp": 1, "pp": 1},
                    "config": {"optimizer": "adamw", "lr": 0.5, "seed": 3}}}
    checkpoint.save(tmp_path / "c.pt", form)
    manifest = import_file(tmp_path / "c.pt", tmp_path / "run")
    assert manifest["step"] == 4 and not manifest["fresh_optimizer"]
    assert manifest["config"] == {"optimizer": "adamw", "lr": 0.5, "seed": 3}
    ck = _shard(tmp_path / "run")
    assert ck["optimizer"]["param_groups"] == groups
    assert torch.equal(ck["optimizer"]["state"]["layers.1.ln_1.bias"]["step"], torch.tensor(4.0))
    with pytest.raises(ConfigError, match=r"^checkpoint import: .*c\.pt carries its optimizer's state and "
                                          r"hyperparameters \(adamw\); --weight-decay applies to a fresh optimizer"):
        import_file(tmp_path / "c.pt", tmp_path / "other", weight_decay=0.1)
    assert not (tmp_path / "other").exists()


def test_fresh_optimizer_from_flags_and_config_file(tmp_path):
    torch.save(_weights(), tmp_path / "w.pt")
    (tmp_path / "run.toml").write_text('model = "gpt-tiny"\noptimizer = "sgd"\nweight-decay = 0.01\nmomentum = 0.5\n'
                                       'steps = 100\n')
    assert _import(tmp_path / "w.pt", "--out", tmp_path / "a", "--config", tmp_path / "run.toml",
                   "--momentum", "0.8") == 0  # a flag overrides the file
    assert json.loads((tmp_path / "a" / checkpoint.MANIFEST).read_text())["config"] == {
        "optimizer": "sgd", "weight_decay": 0.01, "momentum": 0.8}
    [group] = _shard(tmp_path / "a")["optimizer"]["param_groups"]
    assert (group["momentum"], group["weight_decay"], group["nesterov"]) == (0.8, 0.01, False)


TIED = """
import torch.nn as nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # one parameter, two names


def make():
    return Tied()
"""


def test_safetensors_with_a_tied_parameter_stored_once(tmp_path, monkeypatch):
    (tmp_path / "tied_nets.py").write_text(TIED)
    monkeypatch.syspath_prepend(str(tmp_path))
    import tied_nets

    model = tied_nets.make()
    save_model(model, str(tmp_path / "tied.safetensors"))  # stores the shared weight under one of its names
    import_file(tmp_path / "tied.safetensors", tmp_path / "run", model="tied_nets:make")
    ck = _shard(tmp_path / "run")
    assert set(ck["model"]) == {"embed.weight", "head.weight"}
    for name in ck["model"]:
        assert torch.equal(ck["model"][name], model.embed.weight.detach()), name


# -- wrong input: one line naming the file, the tensor and the fix; --out untouched -------------------------------
def _bad_inputs(tmp_path):
    w = _weights()
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    torch.save(build_model("gpt-tiny"), tmp_path / "whole.pt")
    torch.save({"model": w, "optimizer": {"state": {}}, "epoch": 3}, tmp_path / "training.pt")
    torch.save({f"module.{k}": v for k, v in w.items()}, tmp_path / "ddp.pt")
    torch.save(_weights(preset="gpt-small"), tmp_path / "small.pt")
    torch.save({k: v for k, v in w.items() if k != "layers.0.wpe.weight"}, tmp_path / "missing.pt")
    torch.save(w | {"head.extra": torch.zeros(2)}, tmp_path / "extra.pt")
    save_file(w, tmp_path / "w.safetensors")
    (tmp_path / "cut.safetensors").write_bytes((tmp_path / "w.safetensors").read_bytes()[:1000])
    torch.save(w, tmp_path / "w.pt")
    checkpoint.save(tmp_path / "future.pt", {"kind": "distrain.full/2", "model": w})


WHAT = ("give a file written by `distrain checkpoint consolidate`, a torch.save(model.state_dict()) file or a "
        ".safetensors file")
BAD = [  # (file, give --model gpt-tiny, the error after "checkpoint import: "; {d}: the folder)
    ("notes.txt", True, "{d}/notes.txt is not a checkpoint (neither torch.save's format nor safetensors); " + WHAT),
    ("nothing.pt", True, "{d}/nothing.pt does not exist; " + WHAT),
    ("whole.pt", True, "{d}/whole.pt holds pickled Python objects, not only tensors (e.g. a whole module saved with "
                       "torch.save(model)); save the weights alone: torch.save(model.state_dict(), path)"),
    ("training.pt", True, "{d}/training.pt is not a state_dict: its entry 'model' is of type OrderedDict, not a "
                          "tensor (3 of 3 entries are not tensors); it looks like a training checkpoint whose 'model' "
                          "is the state_dict: save that alone (torch.save(ckpt['model'], path))"),
    ("w.pt", False, "{d}/w.pt holds model weights alone; name the model the run will train with --model (a preset "
                    "such as gpt-small, or PKG.MOD:FACTORY, as for `distrain train`)"),
    ("ddp.pt", True, "{d}/ddp.pt holds tensor 'module.layers.0.wte.weight', which --model gpt-tiny does not have (69 "
                     "such, 69 of the model's missing); every name in the file starts with 'module.' (saved from a "
                     "wrapper around the model): save the inner model's state_dict, e.g. "
                     "torch.save(model.module.state_dict(), path)"),
    ("small.pt", True, "tensor 'layers.0.wte.weight' of {d}/small.pt has shape (256, 128), --model gpt-tiny has "
                       "(256, 32); import the file with the --model it was saved from, or a file saved from --model "
                       "gpt-tiny"),
    ("missing.pt", True, "{d}/missing.pt has no tensor 'layers.0.wpe.weight', which --model gpt-tiny has (1 of its 69 "
                         "missing); import the file with the --model it was saved from, or a file saved from --model "
                         "gpt-tiny"),
    ("extra.pt", True, "{d}/extra.pt holds tensor 'head.extra', which --model gpt-tiny does not have (1 such, 0 of "
                       "the model's missing); import the file with the --model it was saved from, or a file saved "
                       "from --model gpt-tiny"),
    ("cut.safetensors", True, None),  # the safetensors library's reason, then what import reads
    ("future.pt", True, "{d}/future.pt is a 'distrain.full/2' file; this distrain reads 'distrain.full/1' (what "
                        "`distrain checkpoint consolidate` writes); consolidate the run again with it"),
]


@pytest.mark.parametrize("name,with_model,want", BAD, ids=[b[0] for b in BAD])
def test_wrong_input_is_one_line_and_leaves_out_untouched(tmp_path, capsys, name, with_model, want):
    _bad_inputs(tmp_path)
    out = tmp_path / "run"
    assert _import(tmp_path / name, "--out", out, *(["--model", "gpt-tiny"] if with_model else [])) == 2
    got = _error(capsys)
    if want is None:
        assert re.fullmatch(rf"checkpoint import: {re.escape(str(tmp_path / name))} is not a readable "
                            rf"\.safetensors file \(.+\); {re.escape(WHAT)}", got), got
    else:
        assert got == "checkpoint import: " + want.format(d=tmp_path)
    assert not out.exists()  # checked before anything is written


def _disk_full(*args):
    raise OSError(28, "No space left on device")


def test_no_import_into_a_used_folder_and_no_half_set(tmp_path, capsys, monkeypatch):
    torch.save(_weights(), tmp_path / "w.pt")
    used = tmp_path / "used"
    used.mkdir()
    (used / "metrics.jsonl").write_text("{}\n")
    assert _import(tmp_path / "w.pt", "--out", used, "--model", "gpt-tiny") == 2
    assert _error(capsys) == (f"checkpoint import: --out {used} is not empty (metrics.jsonl); import into a new (or "
                              f"empty) folder")
    # a failure while committing: neither the shard nor a temporary stays behind
    monkeypatch.setattr(checkpoint, "write_manifest", _disk_full)
    out = tmp_path / "run"
    with pytest.raises(OSError, match="No space left"):
        import_file(tmp_path / "w.pt", out, model="gpt-tiny")
    assert sorted(p.name for p in out.iterdir()) == [runlock.LOCK_NAME]


# -- checkpoint consolidate names itself; --resume keeps its messages --------------------------------------------
def test_consolidate_errors_name_the_command(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["checkpoint", "consolidate", str(empty), "-o", str(tmp_path / "x.pt")]) == 2
    assert _error(capsys) == (f"checkpoint consolidate: checkpoint {empty}/checkpoint.json does not exist; give the "
                              f"--out of a run that has saved a checkpoint")
    with pytest.raises(ConfigError) as e:  # what --resume says about the same folder is unchanged
        check_resume(trainer_config(empty, resume=True))
    assert str(e.value) == (f"--resume: checkpoint {empty}/checkpoint.json does not exist; run without --resume to "
                            f"start afresh")

    torch.save(_weights(), tmp_path / "w.pt")
    run = tmp_path / "run"
    import_file(tmp_path / "w.pt", run, model="gpt-tiny")
    shard = run / "checkpoint-00000000-full.pt"
    shard.write_bytes(shard.read_bytes() + b"x")
    assert cli_main(["checkpoint", "consolidate", str(run), "-o", str(tmp_path / "x.pt")]) == 2
    assert _error(capsys) == (f"checkpoint consolidate: {shard} does not match the checksum in checkpoint.json (the "
                              f"file was corrupted or changed after it was written); restore it from a copy")
    with pytest.raises(ConfigError) as e:
        check_resume(trainer_config(run, model="gpt-tiny", resume=True, reshard=True))
    assert str(e.value) == (f"--resume: {shard} does not match the checksum in checkpoint.json (the file was "
                            f"corrupted or changed after it was written); restore it or start afresh")

    with runlock.hold(run):  # a run writing the folder
        assert cli_main(["checkpoint", "consolidate", str(run), "-o", str(tmp_path / "x.pt")]) == 2
    assert re.fullmatch(rf"checkpoint consolidate: {re.escape(str(run))} is in use by a running job \(pid \d+ .*\); "
                        rf"wait for it to end or stop it", _error(capsys))
    assert not (tmp_path / "x.pt").exists()
