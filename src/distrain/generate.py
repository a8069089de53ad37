"""Sample text from a training run's final checkpoint, with the run's own tokenizer.

    from distrain.generate import generate_text
    print(generate_text("runs/bpe", "ROMEO:", max_new_tokens=200, temperature=0.8, top_k=40, seed=0))

The run's committed checkpoint (any layout: single, DDP, ZeRO, dp x tp x pp) is consolidated
into the whole model (checkpoint/reshard.py), rebuilt from its preset with the vocabulary the run
trained with, and sampled with :func:`distrain.models.generate` (the context is cropped to the
model's block size; temperature 0 is greedy). Text is encoded and decoded with the run's
tokenizer: bytes for ``--data shakespeare`` or a text path, and for a token shard folder the
folder's ``tokenizer.json`` (or, when the folder is gone, the copy the run keeps in
``RUN/tokenizer.json``; both are checked against the fingerprint the run recorded in
``RUN/data.json``). ``distrain generate`` (distrain/cli/generate.py) prints :func:`generate_text`'s
result: the prompt followed by the sampled continuation.
"""

from __future__ import annotations

import json
from pathlib import Path

from distrain.errors import ConfigError


def run_tokenizer(run: Path, config: dict):
    """The tokenizer the run trained with (see the module docstring)."""
    import hashlib

    from distrain.data.shards import is_shard_folder, shard_tokenizer
    from distrain.data.tokenizer import ByteTokenizer, Tokenizer
    from distrain.trainer.task import DATA_RECORD

    data = str(config.get("data", ""))
    where = run / DATA_RECORD
    record = json.loads(where.read_text()) if where.is_file() else None
    if record is None or record.get("data") != data:  # not a shard run (or one from before data.json)
        return shard_tokenizer(data) if is_shard_folder(data) else ByteTokenizer()
    candidates = [Path(record.get("path", data)) / "tokenizer.json", Path(data) / "tokenizer.json",
                  run / "tokenizer.json"]
    for path in candidates:
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == record["fingerprint"]:
            tok = Tokenizer.load(path)
            tok.spec = record.get("tokenizer", tok.spec)
            return tok
    raise ConfigError(f"distrain generate: the run {run} trained on the shard folder {data}, whose tokenizer "
                      f"(fingerprint {str(record.get('fingerprint'))[:12]}, {where}) is neither there nor in "
                      f"{run / 'tokenizer.json'}; restore that tokenizer.json")


def load_run_model(run: Path):
    """(model in eval mode, the run's tokenizer, the run's config dict) from the run's committed checkpoint;
    the preset takes the tokenizer's vocabulary when it exceeds 256, as the trainer gave it."""
    import torch

    from distrain.models import build_model, list_models, preset_config
    from distrain import checkpoint
    from distrain.checkpoint.reshard import as_command, consolidate

    if not (run / checkpoint.MANIFEST).is_file():
        raise ConfigError(f"distrain generate: {run / checkpoint.MANIFEST} not found; give the --out of a training "
                          f"run that has saved a checkpoint")
    try:
        form = consolidate(run)
    except ConfigError as e:
        raise ConfigError(as_command(str(e), "generate")) from None
    preset = form["run"].get("model")
    config = form["run"].get("config", {})
    if preset not in list_models():
        raise ConfigError(f"distrain generate: the run {run} trained --model {preset}, not a preset: load its weights "
                          f"yourself (`distrain checkpoint consolidate {run} -o model.pt`) and call "
                          f"distrain.models.generate")
    tok = run_tokenizer(run, config)
    overrides = {}
    if tok.vocab_size > 256 and "vocab_size" in preset_config(preset):  # trainer.task.model_overrides' rule
        overrides["vocab_size"] = tok.vocab_size
    floats = [t for t in form["model"].values() if t.is_floating_point()]
    torch.manual_seed(0)
    model = build_model(preset, **overrides).to(floats[0].dtype if floats else torch.float32)
    try:
        model.load_state_dict(form["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"distrain generate: the checkpoint of {run} does not fit --model {preset} with the run's "
                          f"tokenizer {tok.spec} ({first})") from None
    return model.eval(), tok, config


def generate_text(run, prompt: str = "\n", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0) -> str:
    """The prompt followed by ``max_new_tokens`` tokens sampled from the run folder ``run``'s model
    (``temperature`` 0: greedy; ``top_k`` 0: no limit), decoded with the run's tokenizer; a one-line
    ConfigError for a folder that is no run, a value out of range or a prompt of no token."""
    import torch

    from distrain.models import generate

    run_dir = Path(run)
    if not run_dir.is_dir():
        raise ConfigError(f"distrain generate: {run_dir} is not a run folder (give the --out of a training run)")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: no limit), got {top_k}")
    model, tok, _ = load_run_model(run_dir)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} encodes to no token; give some text")
    idx = torch.tensor([ids], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k or None, generator=g)
    return tok.decode(out[0].tolist())
