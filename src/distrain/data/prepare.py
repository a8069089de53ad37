"""``distrain data prepare``: text files -> token shards that training reads through numpy.memmap.

    distrain data prepare shakespeare --tokenizer bpe:2048 --out data/shakespeare-bpe2048
    distrain data prepare corpus/ more.txt --tokenizer byte --out data/mine --val-fraction 0.05
    distrain data prepare corpus/ --tokenizer ~/models/SmolLM2-135M --out data/smol   # tokenizer.json there

Inputs are ``shakespeare`` (the packaged corpus, data/text.py), ``.txt`` files, or folders
(every ``*.txt`` under them, sorted by relative path), in the order given.

Encoding rule. Each file is read as bytes and, like data/text.py, gets a ``\\n`` appended when
it does not end with one. Each file is encoded on its own (no token spans two files); a long
file is encoded in pieces of about 1 MiB cut right after a ``\\n`` that is followed by a
printable ASCII character (a pre-token boundary of byte-level BPE, so the ids equal those of
encoding the whole file at once). The byte tokenizer stores the raw bytes, so its tokens are
exactly the bytes data/text.py trains on. Tokens are concatenated in file order.

Split rule (as data/text.py): with ``N`` tokens, the last ``floor(N * val_fraction)`` are the
validation split, the rest the training split.

Output folder (written to a temporary folder beside ``--out`` and renamed into place, so
``--out`` never holds a half-written set)::

    tokenizer.json        the tokenizer (tokenizer.py; its sha256 is the fingerprint)
    tokens-00000.bin ...  raw little-endian uint16 ids (uint32 when the vocabulary exceeds 65536),
                          at most --shard-tokens per file; the concatenation is the token stream
    meta.json             {"format": "distrain.shards/1", "vocab_size", "dtype", "fingerprint",
                           "tokenizer": {"spec", "vocab_size", "file", "fingerprint"},
                           "tokens": N, "shards": [{"file", "tokens"}],
                           "splits": {"train": {"start", "tokens"}, "val": {"start", "tokens"}},
                           "val_fraction", "shard_tokens", "sources", "source_bytes"}

A split is a range ``[start, start + tokens)`` of the token stream; shards.py reads windows
of it through numpy.memmap. The command line (distrain/cli/data.py) calls :func:`prepare`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from distrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, parse_bpe_spec
from distrain.errors import ConfigError

FORMAT = "distrain.shards/1"
META_FILE = "meta.json"
DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_BYTES = 1 << 20  # encode in ~1 MiB pieces (see the module docstring)
SAFE_NEXT = bytes(range(0x21, 0x7F))  # printable ASCII, not whitespace: a cut before it is a pre-token boundary


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- inputs
def input_files(inputs: Sequence[str]) -> list[Path]:
    """The .txt files that ``inputs`` name (``shakespeare``, files, folders), in order."""
    from distrain.data.text import corpus_files

    if not inputs:
        raise ConfigError("distrain data prepare: give at least one INPUT (shakespeare, a .txt file or a folder of "
                          ".txt files)")
    files: list[Path] = []
    for item in inputs:
        files.extend(corpus_files(None if item == "shakespeare" else item))
    return files


def file_pieces(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The bytes of ``path`` (plus a final ``\\n`` when missing) in pieces cut by the rule above.

    A piece grows until a safe cut appears; past ``64 * chunk_bytes`` without one (a file
    with no line breaks) it is cut at the last ``\\n`` or UTF-8 character boundary instead."""
    carry = b""
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if not block:
                break
            buf = carry + block
            cut = _safe_cut(buf)
            if cut is None and len(buf) > 64 * chunk_bytes:
                cut = buf.rfind(b"\n") + 1 or _utf8_boundary(buf)
            if cut is None:
                carry = buf
                continue
            yield buf[:cut]  # ends with \n (or, past the limit, at a character boundary)
            carry = buf[cut:]
    if carry:
        yield carry if carry.endswith(b"\n") else carry + b"\n"


def _safe_cut(buf: bytes) -> int | None:
    """The largest i with buf[i-1] == \\n and buf[i] printable ASCII, or None."""
    i = buf.rfind(b"\n", 0, len(buf) - 1)
    while i >= 0:
        if buf[i + 1] in SAFE_NEXT:
            return i + 1
        i = buf.rfind(b"\n", 0, i)
    return None


def _utf8_boundary(buf: bytes) -> int:
    """A cut before the last character's lead byte (never inside a UTF-8 character)."""
    j = len(buf) - 1
    while j > 0 and (buf[j] & 0xC0) == 0x80:
        j -= 1
    return j if j > 0 else len(buf)


def _texts(files: Sequence[Path]) -> Iterator[str]:
    for f in files:
        for piece in file_pieces(f):
            yield piece.decode("utf-8", errors="replace")


# --------------------------------------------------------------------------- writing
class ShardWriter:
    """Appends token arrays to ``tokens-NNNNN.bin`` files of at most ``shard_tokens`` each."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict] = []
        self._f = None

    def write(self, ids: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=self.dtype)
        while ids.size:
            if self._f is None or self.shards[-1]["tokens"] == self.shard_tokens:
                self._open()
            room = self.shard_tokens - self.shards[-1]["tokens"]
            part, ids = ids[:room], ids[room:]
            self._f.write(part.tobytes())
            self.shards[-1]["tokens"] += int(part.size)

    def _open(self) -> None:
        self._close_file()
        name = f"tokens-{len(self.shards):05d}.bin"
        self._f = open(self.folder / name, "wb")
        self.shards.append({"file": name, "tokens": 0})

    def _close_file(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None

    def close(self) -> list[dict]:
        self._close_file()
        return self.shards


def _encode_files(tok: Tokenizer, files: Sequence[Path], writer: ShardWriter, progress: bool) -> None:
    from tqdm.auto import tqdm

    total = sum(f.stat().st_size for f in files)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=f"tokenizing ({tok.spec})", disable=not progress,
               dynamic_ncols=True)
    limit = tok.vocab_size
    try:
        for f in files:
            batch: list[bytes] = []
            for piece in file_pieces(f):
                batch.append(piece)
                if len(batch) == 8:
                    _encode_batch(tok, batch, writer, limit, f)
                    bar.update(sum(len(p) for p in batch))
                    batch = []
            if batch:
                _encode_batch(tok, batch, writer, limit, f)
                bar.update(sum(len(p) for p in batch))
    finally:
        bar.close()


def _encode_batch(tok: Tokenizer, pieces: list[bytes], writer: ShardWriter, limit: int, source: Path) -> None:
    if isinstance(tok, ByteTokenizer):
        for p in pieces:
            writer.write(np.frombuffer(p, dtype=np.uint8))
        return
    texts = [p.decode("utf-8", errors="replace") for p in pieces]
    for ids in tok.encode_batch(texts) if hasattr(tok, "encode_batch") else map(tok.encode, texts):
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= limit):
            raise ConfigError(f"tokenizer {tok.spec} produced id {int(arr.max())} on {source}, outside its vocabulary "
                              f"of {limit}; the tokenizer.json is inconsistent")
        writer.write(arr)


# --------------------------------------------------------------------------- the shard folder
def check_out(out: Path, overwrite: bool) -> None:
    """--out must be absent, empty, or (with --overwrite) a shard folder to replace."""
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the shards")
    held = sorted(p.name for p in out.iterdir())
    if not held:
        return
    listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if not overwrite:
        raise ConfigError(f"--out {out} is not empty ({listed}); pass --overwrite to replace that shard folder, or "
                          f"choose another --out")
    if not (out / META_FILE).is_file():
        raise ConfigError(f"--out {out} holds files that are not a shard folder ({listed}; no {META_FILE}); "
                          f"--overwrite only replaces a folder written by `distrain data prepare`: choose another "
                          f"--out")


def prepare(inputs: Sequence[str], tokenizer: str, out: str | os.PathLike, val_fraction: float = 0.1,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False, progress: bool = True) -> dict:
    """Tokenize ``inputs`` into a shard folder ``out`` (see the module docstring); returns its meta."""
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be a positive integer, got {shard_tokens!r}")
    out = Path(out).expanduser()
    check_out(out, overwrite)
    bpe = parse_bpe_spec(tokenizer)  # a malformed spec fails before any work
    files = input_files(inputs)
    source_bytes = sum(f.stat().st_size for f in files)
    if source_bytes == 0:
        raise ConfigError(f"distrain data prepare: the inputs {list(inputs)} hold no text (every file is empty)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.prepare-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if bpe is not None:
            if progress:
                print(f"training a byte-level BPE of {bpe} tokens on {len(files)} file(s), {source_bytes:,} bytes")
            tok = load_tokenizer(tokenizer, _texts(files))
        else:
            tok = load_tokenizer(tokenizer)
        tok.save(tmp)
        dtype = token_dtype(tok.vocab_size)
        writer = ShardWriter(tmp, dtype, shard_tokens)
        try:
            _encode_files(tok, files, writer, progress)
        finally:
            shards = writer.close()
        n = sum(s["tokens"] for s in shards)
        n_val = math.floor(n * val_fraction)
        spec = tok.spec if bpe is not None or tokenizer == "byte" else str(Path(tokenizer).expanduser().resolve())
        meta = {
            "format": FORMAT, "vocab_size": tok.vocab_size, "dtype": dtype.name, "fingerprint": tok.fingerprint,
            "tokenizer": {"spec": spec, "vocab_size": tok.vocab_size, "file": "tokenizer.json",
                          "fingerprint": tok.fingerprint},
            "tokens": n, "shards": shards,
            "splits": {"train": {"start": 0, "tokens": n - n_val}, "val": {"start": n - n_val, "tokens": n_val}},
            "val_fraction": val_fraction, "shard_tokens": shard_tokens,
            "sources": [str(f) for f in files], "source_bytes": source_bytes,
        }
        with open(tmp / META_FILE, "w") as f:
            f.write(json.dumps(meta, indent=2))
            f.flush()
            os.fsync(f.fileno())
        _place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _place(tmp: Path, out: Path) -> None:
    """Rename the finished folder to ``out`` (replacing an empty folder or, checked before, an old shard set)."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}.tmp"
            os.rename(out, old)
        else:
            out.rmdir()
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
