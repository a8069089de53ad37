"""Checkpoints: written atomically, read without executing pickled code.

Writing goes to a temporary file in the same folder, flushed and fsynced, then renamed
over the target with ``os.replace`` (atomic on POSIX): a crash mid-write leaves the old
checkpoint intact and no half-written file under the real name. Reading uses
``torch.load(weights_only=True)``, which only rebuilds tensors and plain containers, so a
malicious or corrupt file cannot run code; a truncated or corrupt file gives a ConfigError
naming it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from distrain.errors import ConfigError

FORMAT_VERSION = 1


def save(path: str | os.PathLike, state: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save({"format": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"checkpoint {path} does not exist; run without --resume to start afresh")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle opcodes, a non-weights object...
        raise ConfigError(f"checkpoint {path} is corrupt or truncated and cannot be loaded ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:200]}); delete it to start afresh") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"checkpoint {path} is not a distrain checkpoint (format {FORMAT_VERSION})")
    return state
