"""Sample text from a training run's final checkpoint, with the run's own tokenizer.

    from distrain.generate import generate_text
    print(generate_text("runs/bpe", "ROMEO:", max_new_tokens=200, temperature=0.8, top_k=40, top_p=0.95, seed=0))

Which runs: every run whose model can be rebuilt from what the run records (:func:`load_run_model`):

* a preset (``--model llama-small``), with the vocabulary the run trained with;
* a Hugging Face Llama (``--model hf:DIR`` or ``--init-from HF_DIR``): our Llama built from the
  ``model_config`` the run's manifest records (DIR itself is not needed);
* your factory (``--model pkg.mod:factory``): imported and called as the trainer did, when you name
  it again (``model="pkg.mod:factory"``, ``distrain generate RUN --model pkg.mod:factory``: a
  checkpoint never makes distrain import code; it must be importable here: on PYTHONPATH or installed).

The committed checkpoint (any layout: single, DDP, ZeRO, dp x tp x pp) is consolidated into the
whole model (checkpoint/reshard.py) and loaded strictly. A run whose model cannot be rebuilt (a
model passed from Python, a factory that does not import, missing or mismatched weights) is a
one-line ConfigError naming what is wrong and the fix.

Sampling is :func:`distrain.models.generate` (temperature 0: greedy; top-k; top-p; the context
cropped to the model's block size; seeded by ``seed``), with the KV cache of our GPT and Llama
(``use_cache``, on by default: time per token flat in the length). ``use_transformers``: a Llama
run (preset or ``hf:``) is exported to a temporary Hugging Face folder (``distrain checkpoint
export``'s code), loaded with ``LlamaForCausalLM.from_pretrained`` and sampled with transformers'
``generate`` (a factory that returns a transformers model is used as it is); transformers' sampler
draws from torch's global generator, seeded with ``seed`` inside a forked RNG state. Neither stops
at an end-of-sequence token: both give ``max_new_tokens`` tokens.

Text is encoded and decoded with the run's tokenizer: bytes for ``--data shakespeare`` or a text
path, and for a token shard folder the folder's ``tokenizer.json`` (or, when the folder is gone,
the copy the run keeps in ``RUN/tokenizer.json``; both are checked against the fingerprint the run
recorded in ``RUN/data.json``). A run that never trained (``checkpoint import --hf``) of an ``hf:``
model decodes with that folder's ``tokenizer.json`` when it has one. ``distrain generate``
(distrain/cli/generate.py) prints :func:`generate_text`'s result: the prompt followed by the
sampled continuation.
"""

from __future__ import annotations

import json
from pathlib import Path

from distrain.errors import ConfigError

WHO = "distrain generate"


def run_tokenizer(run: Path, config: dict, model_name: str | None = None):
    """The tokenizer the run trained with (see the module docstring)."""
    import hashlib

    from distrain.checkpoint.models import HF, is_hf_name
    from distrain.data.shards import is_shard_folder, shard_tokenizer
    from distrain.data.tokenizer import ByteTokenizer, Tokenizer
    from distrain.trainer.task import DATA_RECORD

    data = str(config.get("data", ""))
    if not data and is_hf_name(model_name) and (Path(model_name[len(HF):]) / "tokenizer.json").is_file():
        return Tokenizer.load(Path(model_name[len(HF):]))  # imported, never trained: the model's own tokenizer
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
    raise ConfigError(f"{WHO}: the run {run} trained on the shard folder {data}, whose tokenizer "
                      f"(fingerprint {str(record.get('fingerprint'))[:12]}, {where}) is neither there nor in "
                      f"{run / 'tokenizer.json'}; restore that tokenizer.json")


def load_run_model(run: Path, model: str | None = None):
    """(model in eval mode, the run's tokenizer, the run's config dict) from the run's committed checkpoint
    (see the module docstring for the models it rebuilds); ``model``: the run's ``--model`` named again (needed
    for a factory, which is imported only when named here); a one-line ConfigError otherwise."""
    import torch

    from distrain import checkpoint
    from distrain.checkpoint.models import is_hf_name, recorded_model
    from distrain.checkpoint.reshard import as_command, consolidate
    from distrain.factories import is_spec

    if not (run / checkpoint.MANIFEST).is_file():
        raise ConfigError(f"{WHO}: {run / checkpoint.MANIFEST} not found; give the --out of a training "
                          f"run that has saved a checkpoint")
    try:
        manifest = checkpoint.read_manifest(run)
        form = consolidate(run, manifest)
    except ConfigError as e:
        raise ConfigError(as_command(str(e), WHO)) from None
    name = form["run"].get("model")
    if model is not None and model != name:
        raise ConfigError(f"{WHO}: the run {run} trained --model {name}, not --model {model}; give --model {name} (or "
                          f"leave --model out for a preset or hf:DIR run)")
    if model is None and is_spec(name) and not is_hf_name(name):
        recorded_model(name, f"{WHO}: the run {run}", "generate from")  # a factory only when named: refused
    config = form["run"].get("config", {})
    tok = run_tokenizer(run, config, name)
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: leave the caller's RNG as it was
        torch.manual_seed(int(config.get("seed", 0) or 0))
        net = _build(run, name, manifest, tok)
    floats = [t for t in form["model"].values() if t.is_floating_point()]
    net = net.to(floats[0].dtype if floats else torch.float32)
    try:
        net.load_state_dict(form["model"])
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0]
        raise ConfigError(f"{WHO}: the checkpoint of {run} does not fit --model {name} as rebuilt here "
                          f"(tokenizer {tok.spec}; {first}); was the factory changed since the run?") from None
    return net.eval(), tok, config


def _build(run: Path, name, manifest: dict, tok):
    """The untrained model ``name`` as the run built it."""
    import torch

    from distrain.checkpoint.models import hf_llama_config, is_hf_name
    from distrain.data.vocab import vocab_override
    from distrain.factories import CUSTOM, is_spec, load_object
    from distrain.models import build_model, list_models, preset_config

    if is_hf_name(name):
        from distrain.models.llama import Llama, LlamaConfig

        if manifest.get("model_config"):
            return Llama(LlamaConfig(**manifest["model_config"]))
        try:  # a run from before manifests recorded model_config: the folder it names
            return Llama(hf_llama_config(name, f"{WHO}: the run {run} trained --model {name}"))
        except ConfigError as e:
            raise ConfigError(f"{e} (the run's manifest records no model_config); restore that folder") from None
    if name in list_models():
        overrides = vocab_override(tok.vocab_size) if "vocab_size" in preset_config(name) else {}
        return build_model(name, **overrides)
    if name == CUSTOM:
        raise ConfigError(f"{WHO}: the run {run} trained a model passed from Python to distrain.train, which nothing "
                          f"here can rebuild; load its weights into your model (`distrain checkpoint consolidate "
                          f"{run} -o model.pt`) and call distrain.models.generate, or train with --model "
                          f"PKG.MOD:FACTORY")
    if not is_spec(name):
        raise ConfigError(f"{WHO}: the run {run} records model {name!r}, which is no preset, hf:DIR or "
                          f"PKG.MOD:FACTORY; give the --out of a text model's training run")
    try:
        model = load_object(name, "--model")()
    except ConfigError as e:  # load_object's "--model SPEC: cannot import M (...); is it on PYTHONPATH?"
        why = str(e).removeprefix(f"--model {name}: ").removesuffix("; is it on PYTHONPATH?")
        raise ConfigError(f"{WHO}: the run {run} trained --model {name}, which cannot be rebuilt here: {why}; install "
                          f"the factory's package or add its folder to PYTHONPATH, and run again") from None
    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"{WHO}: the run {run} trained --model {name}, which now returns a "
                          f"{type(model).__name__}, not an nn.Module")
    return model


def transformers_model(run: Path, model):
    """The run's model as a transformers model: itself when the factory returned one, else a Llama run
    exported to a temporary HF folder (``distrain checkpoint export``) and read back with
    ``LlamaForCausalLM.from_pretrained``; a ConfigError for any other model."""
    import tempfile

    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{WHO} --use-transformers: transformers is not installed; pip install transformers, "
                          f"or sample without --use-transformers") from None
    from distrain.checkpoint.hf import export_hf
    from distrain.models.llama import Llama

    if isinstance(model, transformers.PreTrainedModel):
        return model
    if not isinstance(model, Llama):
        raise ConfigError(f"{WHO} --use-transformers: the run {run} trained a {type(model).__name__}; transformers "
                          f"samples Llama runs (llama-tiny, llama-small, hf:DIR) and factories that return a "
                          f"transformers model; sample without --use-transformers")
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # stdout/stderr carry the text alone
    try:
        with tempfile.TemporaryDirectory(prefix="distrain-generate-") as tmp:
            export_hf(run, Path(tmp) / "hf")
            hf = transformers.LlamaForCausalLM.from_pretrained(Path(tmp) / "hf")
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
    return hf.eval()


def sample_transformers(hf, idx, max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int):
    """transformers' ``generate`` of ``max_new_tokens`` tokens after idx (1, T), seeded (see the module
    docstring); returns (1, T + max_new_tokens)."""
    import torch
    from transformers import GenerationConfig

    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else \
        dict(do_sample=False)
    # eos_token_id None: no early stop (ours never stops early either); pad 0: silences the missing-pad notice
    hf.generation_config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=None, eos_token_id=None,
                                            pad_token_id=0, **sampling)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        return hf.generate(idx, attention_mask=torch.ones_like(idx), generation_config=hf.generation_config)


def generate_text(run, prompt: str = "\n", max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40,
                  seed: int = 0, top_p: float = 1.0, use_cache: bool = True, use_transformers: bool = False,
                  model: str | None = None) -> str:
    """The prompt followed by ``max_new_tokens`` tokens sampled from the run folder ``run``'s model
    (``temperature`` 0: greedy; ``top_k`` 0: no limit; ``top_p`` 1: no nucleus cut; ``use_cache``: our
    KV cache, the same text; ``use_transformers``: transformers' ``generate``), decoded with the run's
    tokenizer; the same ``seed`` gives the same text; ``model``: the run's ``--model`` named again (a factory
    is imported only then: load_run_model). A one-line ConfigError for a folder that is no
    run, a model that cannot be rebuilt, a value out of range or a prompt of no token."""
    import torch

    from distrain.models import generate

    run_dir = Path(run)
    if not run_dir.is_dir():
        raise ConfigError(f"{WHO}: {run_dir} is not a run folder (give the --out of a training run)")
    if max_new_tokens < 0:
        raise ConfigError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0 (0: greedy), got {temperature}")
    if top_k < 0:
        raise ConfigError(f"--top-k must be >= 0 (0: no limit), got {top_k}")
    if not 0 < top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1] (1: no cut), got {top_p}")
    net, tok, _ = load_run_model(run_dir, model)
    ids = tok.encode(prompt)
    if not ids:
        raise ConfigError(f"--prompt {prompt!r} encodes to no token; give some text")
    idx = torch.tensor([ids], dtype=torch.long)
    if use_transformers:
        out = sample_transformers(transformers_model(run_dir, net), idx, max_new_tokens, temperature, top_k,
                                  top_p, seed)
        return tok.decode(out[0].tolist())
    use_cache = use_cache and hasattr(net, "forward_cached")  # a factory's model may have no cache
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        out = generate(net, idx, max_new_tokens, temperature=temperature, top_k=top_k or None,
                       top_p=top_p if top_p < 1 else None, generator=g, use_cache=use_cache)
    return tok.decode(out[0].tolist())
