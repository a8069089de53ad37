"""Hugging Face checkpoints both ways and ``distrain train --init-from``.

``checkpoint import --hf DIR -o RUN`` (one file or a sharded index, GQA and tied configs): our
Llama built from the run gives transformers' logits; ``checkpoint export RUN --hf DIR`` writes a
folder ``LlamaForCausalLM.from_pretrained`` loads with the same logits; ``--init-from HF_DIR``
trains at nproc=2 under ddp and tp=2 exactly like one process (fp64), from those weights (its
first loss is transformers' loss on the first batch), with a fresh optimizer; bad input is a
one-line error naming the file and the fix, and leaves ``-o`` / the export folder as it was."""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from distrain.cli import main as cli_main
from distrain.data import DistributedBatchSampler
from distrain.errors import ConfigError
from distrain.models import build_model
from distrain.models.llama import Llama, LlamaConfig
from distrain import checkpoint
from distrain.checkpoint import init_from
from distrain.trainer import train
from distrain.checkpoint.write import import_file
from distrain.trainer.metrics import read_metrics
from distrain.checkpoint.reshard import consolidate
from distrain.trainer.task import build_task

from conftest import trainer_config

STEPS, BATCH, LR = 3, 8, 1e-2
SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


def _hf_model(seed: int, **kw):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**SIZES, initializer_range=0.1, attn_implementation="eager", **kw)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from their initial ones, so that every weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


# session scope, like _REFERENCE below: with `-n 2 --dist worksteal` a worker may leave this module and come
# back, and a module-scoped fixture would then save the models to a new folder while the cached reference run
# still names the first one (CI saw hf0 against hf1)
@pytest.fixture(scope="session")
def hf(tmp_path_factory):
    """{"gqa" | "tied" | "sharded": (folder, model)}: small random LlamaForCausalLMs saved with save_pretrained."""
    root = tmp_path_factory.mktemp("hf")
    gqa, tied = _hf_model(1), _hf_model(2, tie_word_embeddings=True)
    gqa.save_pretrained(root / "gqa")
    tied.save_pretrained(root / "tied")
    gqa.save_pretrained(root / "sharded", max_shard_size="40KB")
    assert (root / "sharded" / "model.safetensors.index.json").is_file()
    return {"gqa": (root / "gqa", gqa), "tied": (root / "tied", tied), "sharded": (root / "sharded", gqa)}


def _cli(*args) -> int:
    return cli_main([*map(str, args)])


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1, f"not one line: {err!r}"
    return err.removeprefix("distrain: error: ").rstrip("\n")


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(seed))


def _logit_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


# -- import --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "tied", "sharded"])
def test_import_hf_gives_transformers_logits(hf, tmp_path, capsys, kind):
    folder, ref = hf[kind]
    run = tmp_path / "run"
    assert _cli("checkpoint", "import", "--hf", folder, "-o", run) == 0
    assert f"model hf:{folder.resolve()}" in capsys.readouterr().out
    manifest = json.loads((run / checkpoint.MANIFEST).read_text())
    assert manifest["model"] == f"hf:{folder.resolve()}" and manifest["step"] == 0
    assert manifest["hf_config"]["architectures"] == ["LlamaForCausalLM"]
    cfg = LlamaConfig(**manifest["model_config"])
    assert (cfg.n_kv_head, cfg.intermediate_size, cfg.tie_word_embeddings) == (2, 128, kind == "tied")
    model = Llama(cfg).eval()
    model.load_state_dict(consolidate(run)["model"])  # strict: every tensor, by our names
    with torch.no_grad():
        assert _logit_gap(model(_ids()), ref(_ids()).logits) < 1e-5


# -- export --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gqa", "tied"])
def test_export_loads_in_transformers_with_the_same_logits(hf, tmp_path, capsys, kind):
    from transformers import LlamaForCausalLM

    folder, ref = hf[kind]
    run, out = tmp_path / "run", tmp_path / "export"
    assert _cli("checkpoint", "import", "--hf", folder, "-o", run) == 0
    assert _cli("checkpoint", "export", run, "--hf", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (ref.config.bos_token_id,
                                                                        ref.config.eos_token_id)
    loaded = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert loaded.dtype == torch.float32
    with torch.no_grad():
        assert _logit_gap(loaded(_ids(1)).logits, ref(_ids(1)).logits) < 1e-5
    for name, t in ref.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name


def test_export_a_llama_preset_run_and_import_it_back(tmp_path, capsys):
    LlamaForCausalLM = pytest.importorskip("transformers").LlamaForCausalLM  # noqa: N806

    torch.manual_seed(5)
    ours = build_model("llama-tiny").eval()
    torch.save(ours.state_dict(), tmp_path / "w.pt")
    import_file(tmp_path / "w.pt", tmp_path / "run", model="llama-tiny")
    assert _cli("checkpoint", "export", tmp_path / "run", "--hf", tmp_path / "export") == 0
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "export", attn_implementation="eager").eval()
    with torch.no_grad():
        assert _logit_gap(loaded(_ids(2)).logits, ours(_ids(2))) < 1e-5
    # its config is llama-tiny's: importing it back gives that preset (no hf:DIR model)
    assert _cli("checkpoint", "import", "--hf", tmp_path / "export", "-o", tmp_path / "back") == 0
    manifest = json.loads((tmp_path / "back" / checkpoint.MANIFEST).read_text())
    assert manifest["model"] == "llama-tiny" and "model_config" not in manifest


def test_export_refuses_other_models_and_leaves_nothing_on_failure(hf, tmp_path, capsys, monkeypatch):
    torch.manual_seed(0)
    torch.save(build_model("gpt-tiny").state_dict(), tmp_path / "w.pt")
    import_file(tmp_path / "w.pt", tmp_path / "gpt", model="gpt-tiny")
    assert _cli("checkpoint", "export", tmp_path / "gpt", "--hf", tmp_path / "out") == 2
    assert _error(capsys) == (f"checkpoint export: {tmp_path / 'gpt'} trained --model gpt-tiny; --hf writes Llama "
                              f"models only: llama-tiny, llama-small, llama-moe-tiny, or one from Hugging Face (`distrain checkpoint "
                              f"import --hf`, `distrain train --init-from HF_DIR`)")
    assert not (tmp_path / "out").exists()

    import safetensors.torch

    def disk_full(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")

    assert _cli("checkpoint", "import", "--hf", hf["gqa"][0], "-o", tmp_path / "run") == 0
    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cli_main(["checkpoint", "export", str(tmp_path / "run"), "--hf", str(tmp_path / "out")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpt", "run", "w.pt"]  # no DIR, no temporary


# -- train --init-from ---------------------------------------------------------------------------------------
def _config(out, source, **kw):
    base = dict(model=None, init_from=str(source), strategy="single", nproc=1, steps=STEPS, batch_size=BATCH,
                lr=LR, log_every=1)
    return trainer_config(out, **{**base, **kw})


def _losses(out) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


_REFERENCE: dict = {}


def _reference(hf, tmp_path_factory) -> dict:
    """One process from the gqa folder (fp64): its losses and final checkpoint, once."""
    if not _REFERENCE:
        out = tmp_path_factory.mktemp("one-process")
        train(_config(out, hf["gqa"][0]))
        _REFERENCE.update(out=out, losses=_losses(out), manifest=json.loads((out / checkpoint.MANIFEST).read_text()),
                          final=consolidate(out))
    return _REFERENCE


def _first_batch_loss(hf, out) -> float:
    """transformers' loss (fp64) on the trainer's first batch, from the folder's weights."""
    cfg = _config(out, hf["gqa"][0])
    task = build_task(cfg, SIZES["max_position_embeddings"])
    x, y = task.batch(task.train, DistributedBatchSampler(len(task.train), BATCH, dp_rank=0, dp_size=1,
                                                          seed=cfg.seed).batch(0))
    model = copy.deepcopy(hf["gqa"][1]).double()
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).item()


@pytest.mark.timeout(110)
def test_init_from_hf_one_process_starts_from_the_weights_with_a_fresh_optimizer(hf, tmp_path_factory):
    ref = _reference(hf, tmp_path_factory)
    assert len(ref["losses"]) == STEPS
    # transformers computes the rotary angles in float32 even in a float64 model: agreement to ~1e-9
    assert math.isclose(ref["losses"][0], _first_batch_loss(hf, ref["out"]), rel_tol=1e-7)
    assert ref["losses"][-1] < ref["losses"][0]
    manifest = ref["manifest"]
    assert manifest["model"] == f"hf:{hf['gqa'][0].resolve()}" and manifest["step"] == STEPS
    assert manifest["model_config"]["intermediate_size"] == 128  # --resume / export rebuild it without the folder
    opt = ref["final"]["optimizer"]
    assert [g["lr"] for g in opt["param_groups"]] == [LR]
    assert {float(s["step"]) for s in opt["state"].values()} == {float(STEPS)}  # from 0: a fresh optimizer


@pytest.mark.timeout(110)
@pytest.mark.parametrize("layout", [dict(strategy="ddp"), dict(strategy="ddp", tp=2)], ids=["ddp", "tp2"])
def test_init_from_hf_at_two_processes_equals_one_process(hf, tmp_path, tmp_path_factory, layout):
    ref = _reference(hf, tmp_path_factory)
    out = tmp_path / "run"
    train(_config(out, hf["gqa"][0], nproc=2, **layout))
    losses = _losses(out)
    assert math.isclose(losses[0], ref["losses"][0], rel_tol=1e-12, abs_tol=0)
    assert losses == pytest.approx(ref["losses"], rel=1e-10, abs=0)
    final = consolidate(out)
    for name, t in ref["final"]["model"].items():
        assert torch.allclose(final["model"][name], t, rtol=1e-9, atol=1e-12), name
    assert {float(s["step"]) for s in final["optimizer"]["state"].values()} == {float(STEPS)}


@pytest.mark.timeout(110)
def test_init_from_an_imported_run_or_a_file_equals_init_from_the_folder(hf, tmp_path, tmp_path_factory, capsys):
    ref = _reference(hf, tmp_path_factory)
    imported = tmp_path / "imported"
    assert _cli("checkpoint", "import", "--hf", hf["gqa"][0], "-o", imported) == 0
    out = tmp_path / "from-run"
    train(_config(out, imported))  # the imported run's optimizer (lr 3e-3) is not this run's
    assert _losses(out) == ref["losses"]
    # a consolidated file of it: the same weights, the same model
    assert _cli("checkpoint", "consolidate", imported, "-o", tmp_path / "c.pt") == 0
    cfg = _config(tmp_path / "x", tmp_path / "c.pt")
    init_from.resolve(cfg)
    assert cfg.model == f"hf:{hf['gqa'][0].resolve()}"
    init_from.check(cfg)
    got, want = init_from.state_dict(tmp_path / "c.pt"), init_from.state_dict(hf["gqa"][0])
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


# -- wrong input: one line naming the file and the fix; -o, --out and the export folder untouched -------------------
def _bad_folders(hf, d):
    (d / "bert").mkdir()
    (d / "bert" / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert",
                                                        "hidden_size": 64}))
    shutil.copytree(hf["sharded"][0], d / "cut")
    index = json.loads((d / "cut" / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[-1]
    (d / "cut" / lost).unlink()
    shutil.copytree(hf["gqa"][0], d / "shape")
    w = load_file(d / "shape" / "model.safetensors")
    w["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)
    save_file(w, d / "shape" / "model.safetensors", metadata={"format": "pt"})
    return lost


KV = ("tensor 'model.layers.0.self_attn.k_proj.weight' has shape (64, 64), but the config needs (32, 64) "
      "(num_key_value_heads*head_dim x hidden_size; config: vocab_size=256, hidden_size=64, num_hidden_layers=2, "
      "num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False); "
      "fix the config to match the checkpoint")
BERT = ("config.json describes BertModel (model_type 'bert'), not LlamaForCausalLM; distrain reads and writes "
        "Llama-family checkpoints (model_type 'llama', or 'mixtral': MixtralForCausalLM): give such a model folder")
BAD = [  # (folder, extra train flags, the error after the prefix); {d}: tmp_path, {lost}: the missing shard
    ("bert", [], "{d}/bert/" + BERT),
    ("cut", [], "{d}/cut/model.safetensors.index.json names {lost}, which is not in {d}/cut; the download is "
                "incomplete: fetch the missing shard files"),
    ("shape", [], "{d}/shape/model.safetensors: " + KV),
]


@pytest.mark.parametrize("name,flags,want", BAD, ids=[b[0] for b in BAD])
def test_bad_hf_folders_are_one_line_errors_that_write_nothing(hf, tmp_path, capsys, name, flags, want):
    lost = _bad_folders(hf, tmp_path)
    want = want.format(d=tmp_path, lost=lost)
    assert _cli("checkpoint", "import", "--hf", tmp_path / name, "-o", tmp_path / "run") == 2
    assert _error(capsys) == "checkpoint import: " + want
    assert not (tmp_path / "run").exists()
    assert _cli("train", "--init-from", tmp_path / name, "--out", tmp_path / "run", "--no-progress", *flags) == 2
    assert _error(capsys) == "--init-from: " + want
    assert not (tmp_path / "run").exists()


def test_init_from_refuses_resume_another_model_and_weights_of_another_shape(hf, tmp_path, capsys):
    folder = hf["gqa"][0]
    out = tmp_path / "run"
    assert _cli("train", "--init-from", folder, "--resume", "--out", out) == 2
    assert _error(capsys) == ("--init-from starts a new run from a checkpoint's weights (step 0, a fresh optimizer); "
                              "--resume continues --out's own run exactly: give one of them (--resume auto continues "
                              "a restarted job's own run once it has a checkpoint)")
    assert _cli("train", "--init-from", folder, "--model", "gpt-tiny", "--out", out) == 2
    assert _error(capsys) == (f"--init-from {folder} holds model hf:{folder.resolve()}, but --model is gpt-tiny: the "
                              f"run trains the checkpoint's model; leave --model out (model=None from Python) or give "
                              f"--model hf:{folder.resolve()}")
    torch.save(build_model("llama-tiny").state_dict(), tmp_path / "w.pt")  # intermediate_size 192, not 128
    assert _cli("train", "--init-from", tmp_path / "w.pt", "--model", f"hf:{folder}", "--out", out) == 2
    assert _error(capsys) == (f"--init-from: tensor 'layers.1.feed_forward.w1.weight' of {tmp_path / 'w.pt'} has "
                              f"shape (192, 64), --model hf:{folder.resolve()} has (128, 64); give --init-from a "
                              f"checkpoint of --model hf:{folder.resolve()}, or leave --model out to train the "
                              f"checkpoint's own model")
    assert _cli("train", "--init-from", tmp_path / "w.pt", "--out", out) == 2
    assert _error(capsys) == (f"--init-from {tmp_path / 'w.pt'} holds model weights alone (no model recorded); name "
                              f"the model they belong to with --model (a preset, hf:DIR or PKG.MOD:FACTORY)")
    hf_file = tmp_path / "model.safetensors"
    shutil.copyfile(folder / "model.safetensors", hf_file)
    assert _cli("train", "--init-from", hf_file, "--model", "llama-tiny", "--out", out) == 2
    assert _error(capsys).endswith("it holds Hugging Face names: give --init-from the model's folder (config.json "
                                   "beside the .safetensors files)")
    assert not out.exists()
    with pytest.raises(ConfigError, match="^--init-from starts a new run"):
        train(_config(out, folder, resume=True))
