"""Hugging Face ``LlamaForCausalLM`` folders: ``distrain checkpoint import --hf`` and ``export``.

    import_hf(DIR, RUN)                                    # `distrain checkpoint import --hf DIR -o RUN`
    export_hf(RUN, DIR)                                    # `distrain checkpoint export RUN --hf DIR`

A folder is what ``save_pretrained`` writes: ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``) with its shards.
The name and shape mapping is :mod:`distrain.models.llama.hf`'s (pure, no I/O); reading a folder
(``read_config``, ``load_llama``) is checkpoint/read.py's; this module writes folders and does
the two verbs, and names the file and the fix in every error (one line, ConfigError).

Export writes ``config.json`` (transformers 4 and 5 read it: both rope forms, ``dtype``),
``model.safetensors`` (one file; a tied ``lm_head.weight`` is left out, as HF does, and tied
again on load), ``generation_config.json`` (the token ids the imported config had) and the run's
``tokenizer.json`` when it trained on token shards of a Hugging Face tokenizer, with its tokenizer
config (``tokenizer_config.json``, ``special_tokens_map.json``, a chat template: the source folder's,
or bos/eos/pad from config.json; :func:`tokenizer_config_files`), into a temporary
folder beside DIR that is renamed to DIR at the end: DIR holds all of it or nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from distrain import runlock
from distrain.checkpoint import reshard, store
from distrain.checkpoint.form import whole
from distrain.checkpoint.models import EXPORTABLE, hf_llama_config, is_hf_name, llama_model_name
from distrain.checkpoint.read import ARCH, CONFIG, IMPORT, SINGLE, load_llama
from distrain.checkpoint.write import import_form
from distrain.errors import ConfigError

EXPORT = "checkpoint export"
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


# -- import: an HF folder -> a run folder ---------------------------------------------------------------
def import_hf(folder: str | os.PathLike, out: str | os.PathLike, **settings) -> dict:
    """``checkpoint import --hf DIR -o RUN``: RUN's checkpoint holds DIR's weights (step 0, a fresh optimizer
    from ``settings``); its manifest records the model: a preset when DIR's config is one, else ``hf:DIR``
    with ``model_config`` (our LlamaConfig) and ``hf_config`` (DIR's config.json), which the trainer builds."""
    cfg, sd, config = load_llama(folder, IMPORT)
    name = llama_model_name(cfg, folder)
    form = whole(sd, None, step=0, run={"model": name, "strategy": None, "layout": {"hf": Path(folder).name},
                                         "config": {}})
    extra = {"model_config": dataclasses.asdict(cfg), "hf_config": config} if name.startswith("hf:") else {}
    return import_form(folder, form, out, True, extra, **settings)


# -- export: a run folder -> an HF folder -----------------------------------------------------------------
def export_hf(run: str | os.PathLike, folder: str | os.PathLike) -> dict:
    """``checkpoint export RUN --hf DIR``: RUN's committed weights (any layout) as an HF LlamaForCausalLM folder.
    Returns the config.json written."""
    from distrain.models import preset_config
    from distrain.models.llama import LlamaConfig, to_hf

    run, folder = Path(run), Path(folder)
    if not run.is_dir():
        raise ConfigError(f"{EXPORT}: {run} is not a run folder (give the --out of a training run, or of "
                          f"`distrain checkpoint import`)")
    _refuse_used(folder)
    try:
        with runlock.hold(run):  # no run may commit a new set while we read this one
            manifest = store.read_manifest(run)
            form = reshard.consolidate(run, manifest)
    except ConfigError as e:
        raise ConfigError(reshard.as_command(str(e), EXPORT)) from None
    model, sd = manifest.get("model"), form["model"]
    if is_hf_name(model):
        cfg = LlamaConfig(**manifest["model_config"]) if manifest.get("model_config") else \
            hf_llama_config(model, EXPORT)
    elif model in EXPORTABLE:
        rows = sd.get("layers.0.tok_embeddings.weight")  # a preset takes a token shard folder's vocabulary
        cfg = LlamaConfig(**preset_config(model, **({"vocab_size": rows.shape[0]} if rows is not None else {})))
    else:
        raise ConfigError(f"{EXPORT}: {run} trained --model {model}; --hf writes Llama models only: "
                          f"{', '.join(EXPORTABLE)}, or one from Hugging Face (`distrain checkpoint import --hf`, "
                          f"`distrain train --init-from HF_DIR`)")
    try:
        hf_sd, hf_cfg = to_hf(sd, cfg)
    except ConfigError as e:
        raise ConfigError(f"{EXPORT}: {run}: {str(e).removeprefix('to_hf: ')}") from None
    if cfg.tie_word_embeddings:
        hf_sd.pop("lm_head.weight")  # the embedding itself; HF ties it again on load
    base = dict(manifest.get("hf_config") or {})  # the imported model's other fields (token ids, ...)
    for k in ("rope_scaling", "rope_parameters", "torch_dtype"):
        base.pop(k, None)
    floats = [t.dtype for t in hf_sd.values() if t.is_floating_point()]
    config = {**base, **hf_cfg, "dtype": str(floats[0] if floats else torch.float32).removeprefix("torch.")}
    generation = {"_from_model_config": True, **{k: config[k] for k in GENERATION_KEYS if config.get(k) is not None}}
    files = _run_tokenizer(run)
    if files:
        files.update(tokenizer_config_files(files["tokenizer.json"], config, _source_folders(manifest)))
    write_hf(folder, hf_sd, config, generation, files)
    return config


TOKENIZER_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _source_folders(manifest: dict) -> list[Path]:
    """The Hugging Face folders a run came from (its --init-from, its hf:DIR), where they still exist."""
    out = [manifest.get("config", {}).get("init_from") or "", manifest.get("model") or ""]
    out[1] = out[1][3:] if is_hf_name(out[1]) else ""
    return [Path(p) for p in out if p and Path(p).is_dir()]


def tokenizer_config_files(tokenizer_json: str, config: dict, sources: list[Path]) -> dict[str, str]:
    """{name: text} of the tokenizer config beside an exported ``tokenizer.json``, so that
    ``AutoTokenizer.from_pretrained`` knows its special tokens: the source folder's tokenizer_config.json,
    special_tokens_map.json and chat_template.jinja (chat template included) when its tokenizer.json has the
    same vocabulary and special tokens; else written from config.json's bos/eos/pad token ids, where each names
    one of the tokenizer's special tokens (an id of ordinary text is left out)."""
    from distrain.checkpoint.init_from import tokenizer_difference
    from distrain.data.tokenizer import HFTokenizer, Tokenizer

    mine = HFTokenizer.from_str(tokenizer_json, spec="run")
    for folder in sources:
        if not (folder / "tokenizer.json").is_file() or not (folder / "tokenizer_config.json").is_file():
            continue
        try:
            same = tokenizer_difference(mine, Tokenizer.load(folder)) is None
        except ConfigError:
            continue
        if same:
            return {n: (folder / n).read_text() for n in TOKENIZER_CONFIG_FILES if (folder / n).is_file()}
    special = {}
    added = {i: t for i, t in mine.tok.get_added_tokens_decoder().items() if t.special}
    for role in ("bos", "eos", "pad"):
        i = config.get(f"{role}_token_id")
        # only a special token of the tokenizer: an id that names an ordinary piece of text (a config's default
        # bos 1 / eos 2 over a tokenizer without special tokens) would make AutoTokenizer add that text
        token = added[i].content if isinstance(i, int) and not isinstance(i, bool) and i in added else None
        if token is not None:
            special[f"{role}_token"] = token
    tc = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **special}
    return {"tokenizer_config.json": json.dumps(tc, indent=2) + "\n",
            "special_tokens_map.json": json.dumps(special, indent=2) + "\n"}


def _run_tokenizer(run: Path) -> dict[str, str]:
    """The run's tokenizer.json (a token shard folder's, copied there by the trainer) when it is a Hugging Face
    one (distrain's byte tokenizer is a stub no one else reads)."""
    path = run / "tokenizer.json"
    try:
        text = path.read_text()
        return {path.name: text} if "model" in json.loads(text) else {}
    except (OSError, ValueError, TypeError):
        return {}


def _refuse_used(folder: Path) -> None:
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(f"{EXPORT}: --hf {folder} " + ("is a file" if not folder.is_dir() else "is not empty")
                          + "; export into a new (or empty) folder")


def write_hf(folder: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict, generation: dict,
             files: dict[str, str] | None = None) -> Path:
    """Write an HF folder atomically (``files``: more {name: text}): everything goes into a temporary folder
    beside it, renamed at the end."""
    from safetensors.torch import save_file

    folder = Path(folder)
    _refuse_used(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        os.chmod(tmp, 0o755)
        save_file({n: t.detach().contiguous() for n, t in tensors.items()}, str(tmp / SINGLE),
                  metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        for name, text in (files or {}).items():
            (tmp / name).write_text(text)
        for name in (SINGLE, CONFIG, "generation_config.json", *(files or {})):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        _refuse_used(folder)  # again: nobody filled it meanwhile
        if folder.is_dir():
            folder.rmdir()  # empty
        os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder
