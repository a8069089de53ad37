"""``distrain train --init-from SOURCE``: a new run that starts from a checkpoint's weights.

SOURCE is one of

* a Hugging Face model folder: ``config.json`` and ``model.safetensors`` or a sharded
  ``model.safetensors.index.json`` of a ``LlamaForCausalLM`` (read by checkpoint/read.py);
* a run folder: its committed checkpoint set, any layout, consolidated (checkpoint/reshard.py);
* a checkpoint file: what ``distrain checkpoint consolidate`` writes, a
  ``torch.save(model.state_dict())`` file or a ``.safetensors`` file (checkpoint/read.py: read_file).

The run is new: step 0, a fresh optimizer built from this run's ``--optimizer``/``--lr``/...,
this run's ``--data``; only the weights come from SOURCE. ``--resume`` is the other thing: it
continues ``--out``'s own run exactly (optimizer state, step, data order), so the two do not
combine (under ``--resume auto``, a restarted job continues its own run and ``--init-from`` is
ignored once that run has a checkpoint).

The model is SOURCE's. A run folder or a consolidated file records its model. An HF folder's
config.json describes a Llama: the preset it equals (llama-tiny, llama-small), or else the model
named ``hf:DIR`` ("the Llama that DIR/config.json describes"; also a ``--model`` of its own,
random weights). ``--model`` may be left out (``model=None`` from Python); given, it must be
that model or one with the same Llama config. Weights alone record no model: give ``--model``.

How an ``hf:`` model travels to the ranks: :func:`resolve` sets ``cfg.model`` (``hf:`` + the
folder's absolute path) before validation; the TrainConfig (model and init_from) goes to every
rank, and each rank builds ``Llama(LlamaConfig(**model_config))`` (:func:`build_model`) with
model_config read from SOURCE (its config.json, or the ``model_config`` an imported or trained
run records in its manifest), then loads SOURCE's whole state dict into that whole model
(:func:`load_into`, strict) before the engine replicates or shards it. Every checkpoint of an
``hf:`` run records ``model_config`` and ``hf_config`` in its manifest (:func:`run_meta`), so
``--resume``, ``--init-from RUN`` and ``distrain checkpoint export`` rebuild it without DIR.

Before any rank starts (:func:`check`): SOURCE is of a recognised kind and readable, and its
tensors have exactly the names and shapes of the model this run builds (built on the meta
device; an HF folder's shapes come from the safetensors headers); an ``hf:`` Llama fits --tp and
--pp. Every error is one line naming the file, the tensor and the fix.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path

import torch

from distrain.checkpoint import reshard
from distrain.checkpoint import store as checkpoint
from distrain.checkpoint.models import (HF, check_weights, hf_llama_config, hf_record, is_hf_name, llama_model_name,
                                        model_state, module_state, recorded_model)
from distrain.checkpoint.read import is_hf_folder, load_llama, read_file
from distrain.data.vocab import model_overrides, shard_folder, vocab_error
from distrain.errors import ConfigError
from distrain.factories import CUSTOM, is_spec
from distrain.models.meta import shapes_only

WHO = "--init-from"
WHAT = ("give a Hugging Face model folder (config.json with model.safetensors or model.safetensors.index.json), a "
        "run folder (with checkpoint.json), or a checkpoint file (`distrain checkpoint consolidate`'s, a "
        "torch.save(model.state_dict()) file or a .safetensors file)")
HF_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def _default_model() -> str:
    from distrain.models.registry import DEFAULT_MODEL

    return DEFAULT_MODEL


# -- what SOURCE is ----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    kind: str                  # "hf", "run" or "file"
    model: str | None          # the model it records (None: weights alone)
    model_config: dict | None  # an hf: model's LlamaConfig fields
    hf_config: dict | None     # an hf: model's config.json


def describe(path) -> Source:
    """What ``--init-from path`` names (read once per process while its files are unchanged: config.json,
    the manifest, or the file)."""
    p = Path(path)
    stamp = tuple(q.stat().st_mtime_ns if q.exists() else 0 for q in (p, p / "config.json", p / "checkpoint.json"))
    return _describe(os.path.abspath(path), stamp, str(path))


@functools.lru_cache(maxsize=8)
def _describe(key: str, stamp: tuple, path: str) -> Source:
    p = Path(path)
    if p.is_dir() and (p / checkpoint.MANIFEST).exists():
        try:
            manifest = checkpoint.read_manifest(p)
        except ConfigError as e:
            raise ConfigError(reshard.as_command(str(e), WHO)) from None
        model, record = manifest.get("model"), {k: manifest.get(k) for k in ("model_config", "hf_config")}
        kind = "run"
    elif p.is_dir():
        if not is_hf_folder(p):
            raise ConfigError(f"{WHO} {p}: the folder holds neither checkpoint.json (a run) nor config.json (a Hugging "
                              f"Face model); {WHAT}")
        record = hf_record(HF + str(p), WHO)
        model, kind = llama_model_name(_llama(record["model_config"]), p), "hf"
    elif p.is_file():
        got, obj = read_file(p, who=WHO, what=WHAT)
        model = obj["run"].get("model") if got == "full" else None
        record, kind = {}, "file"
    else:
        raise ConfigError(f"{WHO} {p}: no such file or folder; {WHAT}")
    if is_hf_name(model) and not record.get("model_config"):  # e.g. a consolidated file: from the model's folder
        record = hf_record(model, f"{WHO} {p} (model {model})")
    if not is_hf_name(model):
        record = {}
    return Source(path, kind, model, record.get("model_config"), record.get("hf_config"))


def _llama(fields: dict):
    from distrain.models.llama import LlamaConfig

    return LlamaConfig(**fields)


def _llama_of(name: str):
    """The LlamaConfig model ``name`` builds (a Llama preset or hf:DIR), else None."""
    from distrain.models import MODEL_PRESETS, preset_config

    if is_hf_name(name):
        return hf_llama_config(name, f"--model {name}")
    if name in MODEL_PRESETS and MODEL_PRESETS[name][0] == "llama":
        return _llama(preset_config(name))
    return None


# -- before validation: which model the run builds ---------------------------------------------------------
def resolve(cfg) -> None:
    """Set ``cfg.model`` (None: left out) to the model this run builds: SOURCE's under --init-from, the
    run's own under --resume, else the default; ``hf:DIR`` with DIR absolute. Call before ``cfg.validate()``."""
    manifest = Path(cfg.out) / checkpoint.MANIFEST
    if cfg.init_from and cfg.resume == "auto" and manifest.exists():
        cfg.init_from = ""  # a restarted job (launch --max-restarts) continues its own run
    if is_hf_name(cfg.model):
        cfg.model = HF + str(Path(cfg.model[len(HF):]).resolve())
    if cfg.init_from and cfg.resume is not True and os.path.exists(cfg.init_from):
        src = describe(cfg.init_from)
        given = cfg.model
        if src.model is None and given is None:
            raise ConfigError(f"{WHO} {cfg.init_from} holds model weights alone (no model recorded); name the model "
                              f"they belong to with --model (a preset, hf:DIR or PKG.MOD:FACTORY)")
        if given is None and src.model == CUSTOM:
            raise ConfigError(f"{WHO} {cfg.init_from} was trained on a model passed from Python; pass it again: "
                              f"distrain.train(model=..., config=TrainConfig(init_from=...)), or give --model")
        if given is None or src.model is None:  # the checkpoint's model: never a factory it names (recorded_model)
            cfg.model = given or recorded_model(src.model, f"{WHO} {cfg.init_from}", "start from")
        elif given not in (src.model, CUSTOM):  # CUSTOM: your model from Python; its shapes are checked
            g, s = _llama_of(given), (_llama(src.model_config) if src.model_config else _llama_of(src.model))
            if g is None or g != s:
                raise ConfigError(f"{WHO} {cfg.init_from} holds model {src.model}, but --model is {given}: the run "
                                  f"trains the checkpoint's model; leave --model out (model=None from Python) or give "
                                  f"--model {src.model}")
    if cfg.model is None:
        cfg.model = _recorded_model(manifest) if cfg.resume and manifest.exists() else _default_model()


def _recorded_model(manifest: Path) -> str:
    """The model --resume continues: the manifest's, when distrain builds it from data alone (a factory it names
    is refused until --model names it: recorded_model)."""
    import json

    try:
        name = json.loads(manifest.read_text()).get("model")
    except (OSError, ValueError, AttributeError, RecursionError):
        return _default_model()  # --resume's own checks say what is wrong with it
    return recorded_model(name or None, f"--resume: {manifest.parent}", "resume") or _default_model()


# -- building the model, in every rank -----------------------------------------------------------------------
def model_config(cfg) -> dict:
    """The LlamaConfig fields of ``hf:`` model ``cfg.model`` (read once per process)."""
    return _hf_run_record(cfg.model, cfg.init_from, str(cfg.out), bool(cfg.resume))["model_config"]


def run_meta(cfg) -> dict:
    """What a checkpoint manifest records beside the model's name: an ``hf:`` model's configs."""
    return _hf_run_record(cfg.model, cfg.init_from, str(cfg.out), bool(cfg.resume)) if is_hf_name(cfg.model) else {}


def _hf_run_record(model: str, init_from: str, out: str, resume: bool) -> dict:
    if init_from:  # resolve() made cfg.model SOURCE's model, or one of the same config
        src = describe(init_from)
        if src.model_config:
            return {"model_config": src.model_config, "hf_config": src.hf_config}
    if resume:
        manifest = checkpoint.read_manifest(out)
        if manifest.get("model_config"):
            return {"model_config": manifest["model_config"], "hf_config": manifest.get("hf_config")}
    return hf_record(model, f"--model {model}")


def build_model(cfg):
    """The model ``cfg.model`` names, as every rank builds it: an ``hf:`` Llama, or a preset with the data's
    vocabulary (your factories are built by UserParts)."""
    if is_hf_name(cfg.model):
        from distrain.models.llama import Llama

        return Llama(_llama(model_config(cfg)))
    from distrain.models import build_model as build_preset

    return build_preset(cfg.model, **model_overrides(cfg))


# -- the weights -------------------------------------------------------------------------------------------
def state_dict(path) -> dict[str, torch.Tensor]:
    """SOURCE's whole state dict by our parameter names."""
    src = describe(path)
    if src.kind == "hf":
        return load_llama(path, WHO)[1]
    if src.kind == "run":
        try:
            return reshard.consolidate(path)["model"]
        except ConfigError as e:
            raise ConfigError(reshard.as_command(str(e), WHO)) from None
    got, obj = read_file(path, who=WHO, what=WHAT)
    return obj["model"] if got == "full" else obj


def _match(cfg, weights: dict, state) -> dict:
    fix = (f"give --init-from a checkpoint of --model {cfg.model}, or leave --model out to train the checkpoint's "
           f"own model")
    if any(n in weights for n in HF_NAMES):
        fix = ("it holds Hugging Face names: give --init-from the model's folder (config.json beside the "
               ".safetensors files)")
    return check_weights(cfg.init_from, weights, cfg.model, who=WHO, fix=fix, state=state)


def load_into(model: torch.nn.Module, cfg) -> None:
    """Every rank: SOURCE's whole state dict into the whole model (strict), before the engine shards it."""
    weights = _match(cfg, state_dict(cfg.init_from), module_state(model))
    with torch.no_grad():
        model.load_state_dict(weights, strict=True)


# -- before any rank starts ---------------------------------------------------------------------------------
_CHECKED: set = set()  # what check() passed in this process (the CLI checks before it takes the run lock)


def check(cfg, parts=None) -> None:
    """--init-from's tensors fit the model this run builds; an ``hf:`` Llama fits --tp, --pp and the data."""
    if not cfg.init_from and not is_hf_name(cfg.model):
        return
    p = Path(cfg.init_from or ".")
    key = (cfg.model, cfg.init_from, cfg.tp, cfg.pp, cfg.data, cfg.resume, id(getattr(parts, "model", None)),
           tuple(q.stat().st_mtime_ns if q.exists() else 0 for q in (p, p / "checkpoint.json")))
    if key in _CHECKED:
        return
    check_tokenizer(cfg)
    if is_hf_name(cfg.model):
        _check_hf_layout(cfg)
    if cfg.init_from:
        _check_weights(cfg, parts)
    _CHECKED.add(key)


def _check_weights(cfg, parts) -> None:
    if describe(cfg.init_from).kind == "hf":
        weights = load_llama(cfg.init_from, WHO, shapes_only=True)[1]  # the headers: no tensor is read
    else:
        weights = state_dict(cfg.init_from)
    _match(cfg, weights, _expected(cfg, parts))


def _expected(cfg, parts):
    """(shapes, tied names) of the model this run builds: yours, your factory's, or built on the meta device."""
    if parts is not None and isinstance(getattr(parts, "model", None), torch.nn.Module):
        return module_state(parts.model)
    if is_spec(cfg.model) and not is_hf_name(cfg.model):
        return model_state(cfg.model)
    with torch.random.fork_rng(devices=[]), shapes_only():
        return module_state(build_model(cfg))


def model_tokenizer_folder(cfg) -> Path | None:
    """The Hugging Face folder whose tokenizer.json the model reads ids of: ``hf:DIR``'s DIR or an HF folder given
    to --init-from, when it holds one; None otherwise (a preset, a run, weights alone, a folder without one)."""
    from distrain.data.tokenizer import TOKENIZER_FILE

    folders = [Path(cfg.model[len(HF):])] if is_hf_name(cfg.model) else []
    src = Path(cfg.init_from) if cfg.init_from else None
    if src is not None and src.is_dir() and not (src / checkpoint.MANIFEST).exists() and is_hf_folder(src):
        folders.insert(0, src)
    return next((f for f in folders if (f / TOKENIZER_FILE).is_file()), None)


def check_tokenizer(cfg) -> None:
    """The data's ids are the model's tokenizer's: a token shard folder's tokenizer (its fingerprint, else its
    vocabulary and special tokens) equals the model folder's tokenizer.json, and byte-level text (``shakespeare``,
    a .txt path) never goes to a model that has a tokenizer of its own. One line naming both tokenizers and the
    `distrain data prepare` command that makes the data with the model's tokenizer."""
    import hashlib
    import shlex

    from distrain.data.tokenizer import TOKENIZER_FILE, Tokenizer

    folder = model_tokenizer_folder(cfg)
    if folder is None or cfg.data_kind != "text":
        return
    path = folder / TOKENIZER_FILE
    shards = shard_folder(cfg)
    if shards is None:  # byte ids
        name = Path(cfg.data).stem if cfg.data != "shakespeare" else "shakespeare"
        raise ConfigError(f"--data {cfg.data} is byte-level text (ids 0-255) but --model {cfg.model} reads the ids "
                          f"of its tokenizer {path}; tokenize the text with it: `distrain data prepare "
                          f"{shlex.quote(cfg.data)} --tokenizer {shlex.quote(str(folder))} --out data/{name}` and "
                          f"train with --data data/{name}")
    from distrain.data.shards import read_meta, shard_tokenizer

    meta = read_meta(shards, check_files=False)
    if hashlib.sha256(path.read_bytes()).hexdigest() == meta["fingerprint"]:
        return
    mine, theirs = Tokenizer.load(path), shard_tokenizer(shards, meta)
    differs = tokenizer_difference(theirs, mine)
    if differs is None:
        return  # the same vocabulary and special tokens, written out differently
    inputs = " ".join(shlex.quote(str(s)) for s in meta.get("sources") or []) or "INPUT..."
    raise ConfigError(f"--data {shards} was tokenized with {meta['tokenizer']['spec']} (vocabulary "
                      f"{meta['vocab_size']}, fingerprint {meta['fingerprint'][:12]}) but --model {cfg.model} reads "
                      f"the ids of {path} (vocabulary {mine.vocab_size}, fingerprint "
                      f"{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}): {differs}; re-make the shards with the "
                      f"model's tokenizer: `distrain data prepare {inputs} --tokenizer {shlex.quote(str(folder))} "
                      f"--out {shlex.quote(str(shards))} --overwrite`")


def tokenizer_difference(data_tok, model_tok) -> str | None:
    """What differs between two tokenizers' vocabularies and special tokens (None: nothing)."""
    if data_tok.vocab_size != model_tok.vocab_size:
        return f"{data_tok.vocab_size} ids against {model_tok.vocab_size}"
    tok_a, tok_b = getattr(data_tok, "tok", None), getattr(model_tok, "tok", None)
    if tok_a is None or tok_b is None:
        return "a byte tokenizer against a Hugging Face one"
    special = [{(t.content, i) for i, t in tok.get_added_tokens_decoder().items() if t.special}
               for tok in (tok_a, tok_b)]
    if special[0] != special[1]:
        only = sorted(c for c, _ in special[1] ^ special[0])
        return f"their special tokens differ ({', '.join(only[:4])})"
    if tok_a.get_vocab(with_added_tokens=True) != tok_b.get_vocab(with_added_tokens=True):
        return "the same number of ids for other tokens"
    return None


def _check_hf_layout(cfg) -> None:
    from distrain.models.llama import check_llama_tp_sizes

    c = _llama(model_config(cfg))
    if cfg.tp > 1:
        try:
            check_llama_tp_sizes(cfg.tp, n_head=c.n_head, n_kv_head=c.n_kv_head,
                                 intermediate_size=c.intermediate_size, vocab_size=c.vocab_size)
        except ConfigError as e:
            raise ConfigError(f"--tp {cfg.tp}: --model {cfg.model}: {e}") from None
    n_layers = c.n_layer + 2
    if cfg.pp > n_layers:
        raise ConfigError(f"--pp {cfg.pp}: --model {cfg.model} has {n_layers} layers (embedding, {c.n_layer} blocks, "
                          f"head); use at most {n_layers} stages")
    if cfg.pp > 1 and c.tie_word_embeddings:
        raise ConfigError(f"--pp {cfg.pp}: --model {cfg.model} ties its head to the embedding "
                          f"(tie_word_embeddings=true), and they cannot share a weight across pipeline stages; train it "
                          f"with --pp 1 (tensor and data parallelism work)")
    folder = shard_folder(cfg)
    if folder is not None:
        from distrain.data.shards import read_meta

        meta = read_meta(folder, check_files=False)
        if int(meta["vocab_size"]) > c.vocab_size:
            raise ConfigError(vocab_error(cfg, c.vocab_size, meta))
    elif cfg.data_kind == "text" and c.vocab_size < 256:
        raise ConfigError(f"--data {cfg.data} is byte-level text (ids 0-255) but --model {cfg.model} has vocab_size "
                          f"{c.vocab_size}; give a token shard folder made with the model's tokenizer (`distrain data "
                          f"prepare`)")
