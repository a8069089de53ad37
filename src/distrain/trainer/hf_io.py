"""Checkpoints on disk in other formats: Hugging Face ``LlamaForCausalLM`` folders (read and
written) and one checkpoint file (``read_file``: a torch.save file or a .safetensors file).

    config = read_config(DIR, who)                         # config.json (errors begin "{who}: ")
    cfg, sd, config = load_llama(DIR, who)                 # our LlamaConfig and state dict (models/llama/hf.py)
    import_hf(DIR, RUN)                                    # `distrain checkpoint import --hf DIR -o RUN`
    export_hf(RUN, DIR)                                    # `distrain checkpoint export RUN --hf DIR`

A folder is what ``save_pretrained`` writes: ``config.json`` and either ``model.safetensors`` or
``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``) with its shards.
The name and shape mapping is :mod:`distrain.models.llama.hf`'s (pure, no I/O); this module only
reads and writes files, and names the file and the fix in every error (one line, ConfigError).

Export writes ``config.json`` (transformers 4 and 5 read it: both rope forms, ``dtype``),
``model.safetensors`` (one file; a tied ``lm_head.weight`` is left out, as HF does, and tied
again on load), ``generation_config.json`` (the token ids the imported config had) and the run's
``tokenizer.json`` when it trained on token shards of a Hugging Face tokenizer, into a temporary
folder beside DIR that is renamed to DIR at the end: DIR holds all of it or nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
import shutil
import struct
import tempfile
from pathlib import Path

import torch

from distrain.errors import ConfigError

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
ARCH = "LlamaForCausalLM"
EXPORT = "checkpoint export"
# presets that train (and so export) as they are; shape-only presets are for the cost model
EXPORTABLE = ("llama-tiny", "llama-small")
GENERATION_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def add_arguments(sub, imp) -> None:
    """``checkpoint import --hf HF_DIR`` (on parser ``imp``) and ``checkpoint export`` (on subparsers ``sub``)."""
    imp.add_argument("--hf", default=None, metavar="HF_DIR",
                     help="instead of FILE: a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors or "
                          "a sharded index); the model is the one its config.json describes")
    e = sub.add_parser("export", help="a Llama run's committed weights (any layout) as a Hugging Face folder",
                       description="Write config.json, model.safetensors and generation_config.json that "
                                   "transformers' LlamaForCausalLM.from_pretrained(HF_DIR) loads. See docs/llama.md.")
    e.add_argument("run", metavar="RUN_DIR", help="the run folder (llama-tiny, llama-small, or a model from Hugging "
                                                 "Face)")
    e.add_argument("--hf", required=True, metavar="HF_DIR", help="a new (or empty) folder to write")


def run(args, settings: dict) -> int:
    """``checkpoint export`` and ``checkpoint import --hf``."""
    from distrain.trainer.checkpoint_cli import IMPORT

    if args.action == "export":
        config = export_hf(args.run, args.hf)
        print(f"{args.hf}: {ARCH} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}, vocab "
              f"{config['vocab_size']}, {config['dtype']}); load it with LlamaForCausalLM.from_pretrained({args.hf!r})")
        return 0
    if args.file is not None:
        raise ConfigError(f"{IMPORT}: give FILE or --hf HF_DIR, not both")
    if settings.pop("model") is not None:
        raise ConfigError(f"{IMPORT}: --hf takes the model from {args.hf}/{CONFIG}; leave --model out")
    manifest = import_hf(args.hf, args.out, **settings)
    print(f"{args.out}: {args.hf} as a checkpoint at step 0, model {manifest['model']}; train from it with "
          f"`distrain train --init-from {args.out} --data ... --out NEW_RUN` in any layout")
    return 0


def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with a ``config.json`` (an HF model folder, or meant as one)."""
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_config(folder: str | os.PathLike, who: str) -> dict:
    """``folder/config.json`` of a LlamaForCausalLM, or a one-line ConfigError naming the file."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{who}: {folder} has no {CONFIG}, so it is no Hugging Face model folder; give the folder "
                          f"that save_pretrained (or a download of the model) wrote")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{who}: {path} is not readable JSON ({_first_line(e)}); download the model again") from None
    if not isinstance(config, dict) or not ("model_type" in config or "architectures" in config):
        raise ConfigError(f"{who}: {path} is not a Hugging Face model config (it has no model_type or architectures); "
                          f"give the folder that save_pretrained wrote")
    archs = config.get("architectures") or []
    if (archs and ARCH not in archs) or config.get("model_type", "llama") != "llama":
        what = ", ".join(archs) or "no architecture"
        raise ConfigError(f"{who}: {path} describes {what} (model_type {config.get('model_type')!r}), not {ARCH}; "
                          f"distrain reads and writes Llama-family checkpoints (model_type 'llama'): give such a model "
                          f"folder")
    return config


def weight_files(folder: str | os.PathLike, who: str) -> dict[str, Path]:
    """{HF tensor name: the .safetensors file holding it} of ``folder`` (one file or a sharded index)."""
    from safetensors import safe_open

    folder = Path(folder)
    index, single = folder / INDEX, folder / SINGLE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            assert isinstance(weight_map, dict) and weight_map
        except (OSError, ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError):
            raise ConfigError(f"{who}: {index} is not a safetensors index (JSON with a non-empty \"weight_map\"); "
                              f"download the model again") from None
        files = {name: folder / f for name, f in weight_map.items()}
        absent = sorted({p.name for p in files.values() if not p.is_file()})
        if absent:
            raise ConfigError(f"{who}: {index} names {absent[0]}, which is not in {folder}"
                              + (f" ({len(absent)} shard files missing)" if len(absent) > 1 else "")
                              + "; the download is incomplete: fetch the missing shard files")
        return files
    if single.is_file():
        try:
            with safe_open(str(single), "pt") as f:
                return {name: single for name in f.keys()}
        except Exception as e:  # noqa: BLE001 -- SafetensorError, a truncated header...
            raise ConfigError(f"{who}: {single} is not a readable .safetensors file ({_first_line(e)}); download the "
                              f"model again") from None
    other = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
    hint = (f"it holds {other[0]} (pickle format), which distrain does not read: save the model with "
            f"save_pretrained(DIR) (safetensors, the default)" if other
            else f"give the folder that save_pretrained wrote")
    raise ConfigError(f"{who}: {folder} has neither {SINGLE} nor {INDEX}; {hint}")


def read_weights(folder: str | os.PathLike, who: str, shapes_only: bool = False) -> tuple[dict, dict[str, Path]]:
    """({HF name: tensor}, {HF name: file}); ``shapes_only``: meta tensors from the files' headers (no data read)."""
    from safetensors import safe_open

    files = weight_files(folder, who)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(set(files.values())):
        want = [n for n, p in files.items() if p == path]
        try:
            with safe_open(str(path), "pt", device="cpu") as f:
                held = set(f.keys())
                lost = [n for n in want if n not in held]
                if lost:
                    raise ConfigError(f"{who}: {folder / INDEX} puts tensor {lost[0]!r} in {path}, which does not hold "
                                      f"it; the shard or the index is from another model: download the model again")
                for n in want:
                    if shapes_only:
                        s = f.get_slice(n)
                        out[n] = torch.empty(s.get_shape(), dtype=_dtype(s.get_dtype()), device="meta")
                    else:
                        out[n] = f.get_tensor(n)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 -- a truncated shard, a bad header...
            raise ConfigError(f"{who}: {path} is not a readable .safetensors file ({_first_line(e)}); download the "
                              f"model again") from None
    return out, files


def _dtype(name: str) -> torch.dtype:
    return {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
            "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
            "BOOL": torch.bool}.get(name, torch.float32)


def load_llama(folder: str | os.PathLike, who: str, shapes_only: bool = False):
    """(our LlamaConfig, our state dict, the HF config dict) of HF folder ``folder``; every name and shape is
    checked (``from_hf``) and an error names the file that holds the tensor, or config.json."""
    from distrain.models.llama.hf import config_from_hf, from_hf

    folder = Path(folder)
    config = read_config(folder, who)
    try:
        config_from_hf(config)
    except ConfigError as e:
        raise ConfigError(f"{who}: {folder / CONFIG}: {str(e).removeprefix('from_hf: ')}") from None
    sd, files = read_weights(folder, who, shapes_only)
    if shapes_only and config.get("tie_word_embeddings") and "lm_head.weight" in sd:
        head, emb = sd["lm_head.weight"], sd.get("model.embed_tokens.weight")
        if emb is not None and head.shape == emb.shape:
            sd.pop("lm_head.weight")  # its values are compared with the embedding's when they are read
    try:
        cfg, ours = from_hf(sd, config)
    except ConfigError as e:
        msg = str(e).removeprefix("from_hf: ")
        named = re.search(r"'([^']+)'", msg)
        where = files.get(named.group(1)) if named else None
        raise ConfigError(f"{who}: {where or folder}: {msg}") from None
    return cfg, ours, config


# -- import: an HF folder -> a run folder ---------------------------------------------------------------
def import_hf(folder: str | os.PathLike, out: str | os.PathLike, **settings) -> dict:
    """``checkpoint import --hf DIR -o RUN``: RUN's checkpoint holds DIR's weights (step 0, a fresh optimizer
    from ``settings``); its manifest records the model: a preset when DIR's config is one, else ``hf:DIR``
    with ``model_config`` (our LlamaConfig) and ``hf_config`` (DIR's config.json), which the trainer builds."""
    from distrain.trainer.checkpoint_cli import IMPORT, import_form
    from distrain.trainer.init_from import llama_model_name
    from distrain.trainer.reshard import FULL

    cfg, sd, config = load_llama(folder, IMPORT)
    name = llama_model_name(cfg, folder)
    form = {"kind": FULL, "step": 0, "model": sd, "optimizer": None,
            "run": {"model": name, "strategy": None, "layout": {"hf": Path(folder).name}, "config": {}}}
    extra = {"model_config": dataclasses.asdict(cfg), "hf_config": config} if name.startswith("hf:") else {}
    return import_form(folder, form, out, True, extra, **settings)


# -- export: a run folder -> an HF folder -----------------------------------------------------------------
def export_hf(run: str | os.PathLike, folder: str | os.PathLike) -> dict:
    """``checkpoint export RUN --hf DIR``: RUN's committed weights (any layout) as an HF LlamaForCausalLM folder.
    Returns the config.json written."""
    from distrain import runlock
    from distrain.models import preset_config
    from distrain.models.llama import LlamaConfig, to_hf
    from distrain.trainer import checkpoint, reshard
    from distrain.trainer.init_from import hf_llama_config, is_hf_name

    run, folder = Path(run), Path(folder)
    if not run.is_dir():
        raise ConfigError(f"{EXPORT}: {run} is not a run folder (give the --out of a training run, or of "
                          f"`distrain checkpoint import`)")
    _refuse_used(folder)
    try:
        with runlock.hold(run):  # no run may commit a new set while we read this one
            manifest = checkpoint.read_manifest(run)
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
    write_hf(folder, hf_sd, config, generation, _run_tokenizer(run))
    return config


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


# -- one checkpoint file: `checkpoint import FILE`, `--init-from FILE` --------------------------------
def _is_safetensors(path: Path) -> bool:
    """A .safetensors name, or the format's header: 8 bytes of little-endian JSON length, then '{'."""
    if path.suffix == ".safetensors":
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return head[8:9] == b"{" and 2 <= n <= path.stat().st_size - 8


def read_file(path: str | Path, who: str, what: str) -> tuple[str, dict]:
    """FILE as ``("full", consolidated form)`` or ``("weights", {name: tensor})``; anything else
    is a one-line ConfigError (``who: ...``) saying what the file is and what is read (``what``)."""
    from distrain.trainer.reshard import FULL

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{who}: {path} does not exist" + (" (it is a folder)" if path.is_dir() else "")
                          + f"; {what}")
    if path.stat().st_size == 0:
        raise ConfigError(f"{who}: {path} is empty (0 bytes): it was never written completely; {what}")
    if _is_safetensors(path):
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ConfigError(f"{who}: reading {path} needs the safetensors package (pip install "
                              f"safetensors)") from None
        try:
            return "weights", dict(load_file(str(path), device="cpu"))
        except Exception as e:  # noqa: BLE001 -- SafetensorError, OSError, a bad header...
            raise ConfigError(f"{who}: {path} is not a readable .safetensors file ({_first_line(e)}); "
                              f"{what}") from None
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"PK\x03\x04" and magic[:1] != b"\x80":  # neither torch.save's zip nor its legacy pickle
        raise ConfigError(f"{who}: {path} is not a checkpoint (neither torch.save's format nor safetensors); "
                          f"{what}")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" in str(e):  # a pickled object: torch.save(model), a custom class...
            raise ConfigError(f"{who}: {path} holds pickled Python objects, not only tensors (e.g. a whole "
                              f"module saved with torch.save(model)); save the weights alone: "
                              f"torch.save(model.state_dict(), path)") from None
        raise ConfigError(f"{who}: {path} is not a checkpoint ({type(e).__name__}: {_first_line(e)}); "
                          f"{what}") from None
    except Exception as e:  # noqa: BLE001 -- a truncated zip, a text file, ...
        raise ConfigError(f"{who}: {path} is not a checkpoint ({type(e).__name__}: {_first_line(e)}); "
                          f"{what}") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{who}: {path} holds an object of type {type(obj).__name__}, not a state_dict; save "
                          f"torch.save(model.state_dict(), path)")
    if "kind" in obj and not all(torch.is_tensor(v) for v in obj.values()):
        if obj["kind"] != FULL:
            raise ConfigError(f"{who}: {path} is a {obj['kind']!r} file; this distrain reads {FULL!r} (what "
                              f"`distrain checkpoint consolidate` writes); consolidate the run again with it")
        missing = [k for k in ("step", "model", "optimizer", "run") if k not in obj]
        if missing:
            raise ConfigError(f"{who}: {path} is a consolidated checkpoint without {', '.join(map(repr, missing))}"
                              f"; write it with `distrain checkpoint consolidate RUN_DIR -o FILE`, or import the "
                              f"weights alone (torch.save(ckpt['model'], path))")
        return "full", obj
    bad = [k for k, v in obj.items() if not (isinstance(k, str) and torch.is_tensor(v))]
    if bad:
        k = bad[0]
        inner = [n for n, v in obj.items() if isinstance(v, dict) and v and all(torch.is_tensor(t) for t in v.values())]
        hint = (f"it looks like a training checkpoint whose {inner[0]!r} is the state_dict: save that alone "
                f"(torch.save(ckpt[{inner[0]!r}], path))" if inner else "save torch.save(model.state_dict(), path)")
        raise ConfigError(f"{who}: {path} is not a state_dict: its entry {k!r} is of type {type(obj[k]).__name__}, "
                          f"not a tensor ({len(bad)} of {len(obj)} entries are not tensors); {hint}")
    if not obj:
        raise ConfigError(f"{who}: {path} holds no tensors; {what}")
    return "weights", dict(obj)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
