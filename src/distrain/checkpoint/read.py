"""Checkpoint weights on disk, read and checked for form: one checkpoint file and Hugging Face folders.

    kind, obj = read_file(FILE, who, what)   # ("full", a consolidated form) or ("weights", {name: tensor})
    config = read_config(DIR, who)           # an HF folder's config.json (errors begin "{who}: ")
    cfg, sd, config = load_llama(DIR, who)   # our LlamaConfig and state dict (models/llama/hf.py)

FILE is what ``distrain checkpoint consolidate`` writes, a ``torch.save(model.state_dict())`` file or
a ``.safetensors`` file. An HF folder is what ``save_pretrained`` writes: ``config.json`` and either
``model.safetensors`` or ``model.safetensors.index.json`` (``{"weight_map": {tensor: shard file}}``)
with its shards. Reading only: every error is one line (ConfigError) naming the file and the fix.
Used by ``distrain checkpoint`` (checkpoint/write.py, checkpoint/hf.py) and ``--init-from``
(checkpoint/init_from.py).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
from pathlib import Path

import torch

from distrain.errors import ConfigError
from distrain.checkpoint.form import FULL

CONFIG, SINGLE, INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
ARCH = "LlamaForCausalLM"
ARCHS = {"llama": ARCH, "mixtral": "MixtralForCausalLM"}  # model_type -> architecture (Mixtral: a Llama with moe)
IMPORT = "checkpoint import"
WHAT_IMPORT_READS = ("give a file written by `distrain checkpoint consolidate`, a torch.save(model.state_dict()) "
                     "file or a .safetensors file")


# -- a Hugging Face folder --------------------------------------------------------------------------------
def is_hf_folder(path: str | os.PathLike) -> bool:
    """A folder with a ``config.json`` (an HF model folder, or meant as one)."""
    return Path(path).is_dir() and (Path(path) / CONFIG).is_file()


def read_config(folder: str | os.PathLike, who: str) -> dict:
    """``folder/config.json`` of a LlamaForCausalLM (or MixtralForCausalLM), or a one-line ConfigError naming the
    file."""
    path = Path(folder) / CONFIG
    if not path.is_file():
        raise ConfigError(f"{who}: {folder} has no {CONFIG}, so it is no Hugging Face model folder; give the folder "
                          f"that save_pretrained (or a download of the model) wrote")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ConfigError(f"{who}: {path} is not readable JSON ({_first_line(e)}); download the model again") from None
    if not isinstance(config, dict) or not ("model_type" in config or "architectures" in config):
        raise ConfigError(f"{who}: {path} is not a Hugging Face model config (it has no model_type or architectures); "
                          f"give the folder that save_pretrained wrote")
    archs = config.get("architectures") or []
    kind = config.get("model_type", "llama")
    if kind not in ARCHS or (archs and ARCHS[kind] not in archs):
        what = ", ".join(archs) or "no architecture"
        raise ConfigError(f"{who}: {path} describes {what} (model_type {config.get('model_type')!r}), not {ARCH}; "
                          f"distrain reads and writes Llama-family checkpoints (model_type 'llama', or 'mixtral': "
                          f"MixtralForCausalLM): give such a model folder")
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
        except (OSError, ValueError, KeyError, TypeError, AssertionError, UnicodeDecodeError, RecursionError):
            raise ConfigError(f"{who}: {index} is not a safetensors index (JSON with a non-empty \"weight_map\"); "
                              f"download the model again") from None
        for name, f in weight_map.items():  # file names inside the folder, checked before any file is opened
            if not _plain_name(f):
                raise ConfigError(f"{who}: {index} puts tensor {name!r} in {f!r}, which is not a file name inside "
                                  f"{folder} (no '/', no '..', never an absolute path); download the model again")
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


def _plain_name(name) -> bool:
    """A file name that stays in its folder: a non-empty string without a separator or NUL, not ``.``/``..``
    (so never absolute). A symlink in the folder is its owner's doing (the Hugging Face cache links every
    file of a snapshot to its blobs); a name in an index is data."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name)


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


def _pickled_objects(path) -> bool:
    """Whether the zip checkpoint at ``path`` names Python globals that a weights-only load refuses
    (decided by torch's own scan of the pickle, not by its error's text)."""
    try:
        return bool(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 -- not a zip checkpoint, or a damaged one: not "pickled objects"
        return False


def read_file(path: str | Path, who: str = IMPORT, what: str = WHAT_IMPORT_READS) -> tuple[str, dict]:
    """FILE as ``("full", consolidated form)`` or ``("weights", {name: tensor})``; anything else
    is a one-line ConfigError (``who: ...``) saying what the file is and what is read (``what``)."""
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
        if _pickled_objects(path):  # torch.save(model), a custom class...: globals weights_only refuses
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
