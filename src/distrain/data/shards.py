"""Language-modelling windows over a shard folder (data/prepare.py), read through numpy.memmap.

A split (``train`` or ``val``) is the range ``[start, start + tokens)`` of the token stream
that the shard files make when concatenated in ``meta.json`` order. Window ``i`` of a split
starts at ``s = start + i * stride``: ``x = stream[s : s + T]``, ``y = stream[s + 1 : s + T + 1]``
(the window rule of data/text.py; ``stride`` defaults to ``T = block_size``; a window may span
two shards). ``len = (tokens - T - 1) // stride + 1``.

``get_batch(indices)`` reads only the ``B`` windows asked for: each shard is a read-only
``numpy.memmap`` (opened lazily, advised MADV_RANDOM so the kernel reads no pages around a
window; the pages a batch mapped are unmapped again with MADV_DONTNEED once its tokens are
copied out), so memory stays flat whatever the corpus size, and each data-parallel rank
touches only the windows of its own slice of the batch (DistributedBatchSampler).
"""

from __future__ import annotations

import json
import mmap
import os
import stat
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from distrain.data.text import window_index
from distrain.errors import ConfigError

META_FILE = "meta.json"
FORMAT = "distrain.shards/1"
SPLITS = ("train", "val")

PathLike = Union[str, "os.PathLike[str]"]
Indices = Union[torch.Tensor, np.ndarray, Sequence[int]]


def is_shard_folder(path: PathLike) -> bool:
    """A folder holding ``meta.json`` (what ``--data DIR`` trains on as token shards)."""
    try:
        return Path(path).is_dir() and (Path(path) / META_FILE).is_file()
    except (OSError, TypeError, ValueError):
        return False


def _redo(folder: Path) -> str:
    return f"re-create it with `distrain data prepare INPUT... --tokenizer SPEC --out {folder} --overwrite`"


# the token types `distrain data prepare` writes (prepare.token_dtype): nothing else is read from meta.json
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def plain_name(folder: Path, name, index: Path, field: str) -> Path:
    """``folder / name`` for a file ``name`` that ``index`` lists (its ``field``), checked before anything is
    opened: a plain file name (no separator, not ``.``/``..``, no NUL; so never absolute) naming a regular
    file (not a symlink, FIFO or device) whose resolved path lies inside ``folder``; else a one-line
    ConfigError naming the folder, the field and the fix. A file that does not exist passes (the callers
    say "missing")."""
    if (not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name
            or os.path.basename(name) != name):
        raise ConfigError(f"shard folder {folder}: {index.name} field {field} is {name!r}, not a plain file name "
                          f"inside the folder (no '/', '..' or absolute path); {_redo(folder)}")
    path = folder / name
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as e:
        raise ConfigError(f"shard folder {folder}: {path} (its {index.name} field {field}) cannot be read "
                          f"({e.strerror}); {_redo(folder)}") from None
    if not stat.S_ISREG(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ConfigError(f"shard folder {folder}: {path} (its {index.name} field {field}) is {what}; a shard folder "
                          f"holds its own regular files: copy the file in instead of linking it, or {_redo(folder)}")
    if path.resolve().parent != folder.resolve():
        raise ConfigError(f"shard folder {folder}: {path} (its {index.name} field {field}) resolves outside the "
                          f"folder; {_redo(folder)}")
    return path


def _check_meta(folder: Path, path: Path, meta: dict) -> None:
    """Every field training reads from meta.json, by type and range, before any of it is used (module docstring
    of data/prepare.py: what it writes)."""
    def bad(field: str, why: str) -> ConfigError:
        return ConfigError(f"shard folder {folder}: {path.name} field {field} {why}; {_redo(folder)}")

    if not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES:
        raise bad("dtype", f"is {meta['dtype']!r}; `distrain data prepare` writes token files of "
                           f"{' or '.join(DTYPES)} only")
    limit = 1 << (8 * DTYPES[meta["dtype"]].itemsize)
    if not _is_count(meta["vocab_size"]) or not 0 < meta["vocab_size"] <= limit:
        raise bad("vocab_size", f"is {meta['vocab_size']!r}, not a positive integer that {meta['dtype']} holds "
                                f"(at most {limit:,})")
    if not isinstance(meta["fingerprint"], str):
        raise bad("fingerprint", f"is {meta['fingerprint']!r}, not a sha256 in hex")
    tok = meta["tokenizer"]
    if not (isinstance(tok, dict) and isinstance(tok.get("spec"), str)):
        raise bad("tokenizer", "is not {\"spec\": ..., \"file\": ...}")
    plain_name(folder, tok.get("file", "tokenizer.json"), path, "tokenizer.file")
    shards = meta["shards"]
    if not isinstance(shards, list) or not shards:
        raise bad("shards", "is not a non-empty list of {\"file\", \"tokens\"}")
    for k, s in enumerate(shards):
        if not isinstance(s, dict) or not _is_count(s.get("tokens")):
            raise bad(f"shards[{k}]", f"is {s!r}, not {{\"file\": NAME, \"tokens\": COUNT}}")
        plain_name(folder, s.get("file"), path, f"shards[{k}].file")
    total = sum(s["tokens"] for s in shards)
    if meta["tokens"] != total:
        raise bad("tokens", f"is {meta['tokens']!r} but its shards hold {total:,} tokens")
    splits = meta["splits"]
    for name in SPLITS:
        sp = splits.get(name) if isinstance(splits, dict) else None
        if not (isinstance(sp, dict) and _is_count(sp.get("start")) and _is_count(sp.get("tokens"))):
            raise bad(f"splits.{name}", f"is {sp!r}, not {{\"start\": INDEX, \"tokens\": COUNT}}")
        if sp["start"] + sp["tokens"] > total:
            raise bad(f"splits.{name}", f"ends at token {sp['start'] + sp['tokens']:,} but the shards hold "
                                        f"{total:,}")


def read_meta(folder: PathLike, check_files: bool = True) -> dict:
    """``folder/meta.json``, checked: its keys, each field's type and range (only the token types
    ``data prepare`` writes; shard and tokenizer files are plain names of regular files inside the
    folder; the split ranges within the shards' tokens), and (``check_files``) that every shard
    file is there with the size its token count says. Errors are one line naming the folder, the
    field and the fix."""
    folder = Path(folder)
    path = folder / META_FILE
    try:
        if path.exists() and not path.is_file():  # a FIFO would block the read
            raise ValueError("not a regular file")
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--data {folder}: no {META_FILE} (not a shard folder); make one with `distrain data "
                          f"prepare INPUT... --tokenizer SPEC --out {folder}`") from None
    except (OSError, ValueError, RecursionError) as e:  # (JSONDecodeError, UnicodeDecodeError, nested too deep)
        raise ConfigError(f"shard index {path} cannot be read ({e}); {_redo(folder)}") from None
    need = ("format", "vocab_size", "dtype", "fingerprint", "tokenizer", "tokens", "shards", "splits")
    missing = [k for k in need if k not in meta] if isinstance(meta, dict) else list(need)
    if missing or meta.get("format") != FORMAT:
        why = f"lacks {', '.join(missing)}" if missing else f"has format {meta.get('format')!r}, not {FORMAT!r}"
        raise ConfigError(f"shard index {path} {why}; {_redo(folder)}")
    _check_meta(folder, path, meta)
    itemsize = DTYPES[meta["dtype"]].itemsize
    if check_files:
        for s in meta["shards"]:
            f = folder / s["file"]
            if not f.is_file():
                raise ConfigError(f"shard file {f} (listed in {path}) is missing; restore it or {_redo(folder)}")
            size, want = f.stat().st_size, int(s["tokens"]) * itemsize
            if size != want:
                raise ConfigError(f"shard file {f} has {size:,} bytes but {path} lists {s['tokens']:,} {meta['dtype']} "
                                  f"tokens ({want:,} bytes): it was truncated or replaced; {_redo(folder)}")
    return meta


def shard_tokenizer(folder: PathLike, meta: dict | None = None):
    """The tokenizer saved in a shard folder; ConfigError when its file does not match meta.json's fingerprint."""
    import hashlib

    from distrain.data.tokenizer import TOKENIZER_FILE, Tokenizer

    folder = Path(folder)
    meta = meta or read_meta(folder, check_files=False)
    path = plain_name(folder, meta["tokenizer"].get("file", TOKENIZER_FILE), folder / META_FILE, "tokenizer.file")
    if not path.is_file():
        raise ConfigError(f"tokenizer file {path} (of the shard folder {folder}) is missing; {_redo(folder)}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != meta["fingerprint"]:
        raise ConfigError(f"tokenizer file {path} has sha256 {digest[:12]}... but {folder / META_FILE} records "
                          f"{meta['fingerprint'][:12]}...: the shards were made with another tokenizer; "
                          f"{_redo(folder)}")
    tok = Tokenizer.load(path)
    tok.spec = meta.get("tokenizer", {}).get("spec", tok.spec)
    return tok


class ShardDataset:
    """Windows of ``block_size`` tokens over one split of a shard folder; item ``i`` is ``(x, y)``,
    int64 tensors of shape ``(block_size,)``, ``y`` = ``x`` shifted by one (module docstring)."""

    def __init__(self, folder: PathLike, split: str, block_size: int, stride: int | None = None,
                 meta: dict | None = None):
        if split not in SPLITS:
            raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block_size must be a positive int, got {block_size!r}")
        stride = block_size if stride is None else stride
        if not isinstance(stride, int) or stride < 1:
            raise ConfigError(f"stride must be a positive int, got {stride!r}")
        self.folder = Path(folder)
        self.meta = meta if meta is not None else read_meta(self.folder)
        self.split, self.block_size, self.stride = split, block_size, stride
        self.name = split
        self.vocab_size = int(self.meta["vocab_size"])
        self.dtype = DTYPES[self.meta["dtype"]]  # (read_meta accepted it)
        sp = self.meta["splits"][split]
        self.start, self.tokens = int(sp["start"]), int(sp["tokens"])
        self.counts = [int(s["tokens"]) for s in self.meta["shards"]]
        self.files = [self.folder / s["file"] for s in self.meta["shards"]]  # (plain names: read_meta checked them)
        # shard k holds tokens [offsets[k], offsets[k+1])
        self.offsets = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)])
        if self.start + self.tokens > int(self.offsets[-1]):
            raise ConfigError(f"{self.folder / META_FILE}: split {split} ends at token {self.start + self.tokens:,} "
                              f"but the shards hold {int(self.offsets[-1]):,}; {_redo(self.folder)}")
        if self.tokens < block_size + 1:
            raise ConfigError(
                f"shard folder {self.folder}: the {split} split has {self.tokens:,} tokens, fewer than block_size + 1 "
                f"= {block_size + 1}: use a smaller block_size, more text, or another --val-fraction")
        self._maps: list[np.memmap | None] = [None] * len(self.files)
        self._touched: set[int] = set()

    # ---------------------------------------------------------------- reading
    def _map(self, k: int) -> np.memmap:
        m = self._maps[k]
        if m is None:
            try:  # never through a symlink put there since read_meta checked the folder
                with open(self.files[k], "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
                    m = np.memmap(f, dtype=self.dtype, mode="r")
            except FileNotFoundError:
                raise ConfigError(f"shard file {self.files[k]} (listed in {self.folder / META_FILE}) is missing; "
                                  f"restore it or {_redo(self.folder)}") from None
            if m.size != self.counts[k]:  # replaced since read_meta checked its size
                raise ConfigError(f"shard file {self.files[k]} holds {m.size:,} {self.meta['dtype']} tokens but "
                                  f"{self.folder / META_FILE} lists {self.counts[k]:,}: it was truncated or replaced; "
                                  f"{_redo(self.folder)}")
            raw = getattr(m, "_mmap", None)
            if raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_RANDOM"):
                raw.madvise(mmap.MADV_RANDOM)  # read just the pages a window needs
            self._maps[k] = m
        self._touched.add(k)
        return m

    def _release(self) -> None:
        """Unmap the pages the last reads mapped (MADV_DONTNEED; they stay in the page cache).

        A fault on a file page maps its whole folio (up to 2 MiB on recent kernels), so without
        this the process's file-backed RSS would grow by about a folio per window read, up to
        the corpus size; the tokens were copied out already."""
        for k in self._touched:
            raw = getattr(self._maps[k], "_mmap", None)
            if raw is not None and hasattr(raw, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
                raw.madvise(mmap.MADV_DONTNEED)
        self._touched.clear()

    def read(self, begin: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens ``[begin, end)`` of the whole stream (across shards) as int64."""
        out = np.empty(end - begin, dtype=np.int64) if out is None else out
        k = int(np.searchsorted(self.offsets, begin, side="right")) - 1
        pos = begin
        while pos < end:
            lo, hi = int(self.offsets[k]), int(self.offsets[k + 1])
            take = min(end, hi) - pos
            if take > 0:
                out[pos - begin:pos - begin + take] = self._map(k)[pos - lo:pos - lo + take]
                pos += take
            k += 1
        return out

    def tokens_of_split(self) -> np.ndarray:
        """The whole split as int64 (small corpora and tests only: it reads every token)."""
        try:
            return self.read(self.start, self.start + self.tokens)
        finally:
            self._release()

    def __len__(self) -> int:
        return (self.tokens - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i) -> tuple[torch.Tensor, torch.Tensor]:
        i = window_index(i, len(self))
        x, y = self.get_batch([i])
        return x[0], y[0]

    def get_batch(self, indices: Indices) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)`` of shape ``(len(indices), block_size)``, int64; reads only those windows."""
        if isinstance(indices, torch.Tensor):
            idx = indices.to(dtype=torch.long, device="cpu").reshape(-1).numpy()
        else:
            idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise IndexError(f"window indices must be in [0, {n}), got min {int(idx.min())} max {int(idx.max())}")
        t = self.block_size
        w = np.empty((idx.size, t + 1), dtype=np.int64)
        try:
            for row, i in enumerate(idx.tolist()):
                s = self.start + i * self.stride
                self.read(s, s + t + 1, w[row])
                self._release()  # per window: at most a window's folios are mapped at any time
        finally:
            self._release()
        w = torch.from_numpy(w)
        return w[:, :-1], w[:, 1:]

    # ---------------------------------------------------------------- pickling: no open maps
    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_maps"] = [None] * len(self.files)
        state["_touched"] = set()
        return state

    def __repr__(self) -> str:
        return (f"ShardDataset(folder={str(self.folder)!r}, split={self.split!r}, tokens={self.tokens:,}, "
                f"vocab_size={self.vocab_size}, block_size={self.block_size}, stride={self.stride}, "
                f"windows={len(self)})")


def load_shard_datasets(folder: PathLike, block_size: int, stride: int | None = None
                        ) -> tuple[ShardDataset, ShardDataset | None]:
    """(train, val) of a shard folder; val is None when the folder has no validation tokens."""
    meta = read_meta(folder)
    train = ShardDataset(folder, "train", block_size, stride, meta)
    val = ShardDataset(folder, "val", block_size, stride, meta) if int(meta["splits"]["val"]["tokens"]) else None
    return train, val
