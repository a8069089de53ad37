"""``distrain data prepare``: text in the formats corpora come in -> token shards that training reads
through numpy.memmap.

    distrain data prepare shakespeare --tokenizer bpe:2048 --out data/shakespeare-bpe2048
    distrain data prepare corpus/ more.txt --tokenizer byte --out data/mine --val-fraction 0.05
    distrain data prepare web.jsonl --text-field content --tokenizer ~/models/SmolLM2-135M --out data/web
    distrain data prepare train.parquet saved_dataset/ --tokenizer bpe:8192 --out data/mix

Inputs (data/sources.py, each read as a stream, so memory stays flat whatever the corpus's size):
``shakespeare`` (the packaged corpus), ``.txt`` files, folders of ``*.txt``, ``.jsonl`` files and
``.parquet`` files (the ``--text-field`` of each record, default ``text``), and folders written by
Hugging Face ``datasets``' ``save_to_disk`` (Arrow; ``--split`` of a DatasetDict), in the order given.
A record that cannot be used is skipped, counted and named (``--strict``: the first one stops the
run with its place and reason); so is a line of a text or JSON-lines file holding bytes that its
``--encoding`` (default UTF-8) does not decode, named with the byte offset of the first one.

Encoding rule. Each source is encoded on its own (no token spans two sources): a text file's bytes
plus a final ``\n`` when it lacks one, or a record source's documents, each followed by ``\n``
when it does not end with one (so a ``.jsonl`` gives the same tokens as the ``.txt`` holding the
same documents one after another). A source is encoded in pieces of about 1 MiB cut right after a
``\n`` that is followed by a printable ASCII character (a pre-token boundary of byte-level BPE, so the
ids equal those of encoding the whole source at once). Text is stored as UTF-8 (decoded with
``--encoding`` first); the byte tokenizer stores those bytes, so for a UTF-8 corpus its tokens are
exactly the bytes data/text.py trains on. Tokens are concatenated in source order.

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
                           "val_fraction", "shard_tokens", "encoding", "sources", "source_bytes",
                           "bad_records": {"count", "named"}, "seconds", "tokens_per_s"}

A split is a range ``[start, start + tokens)`` of the token stream; shards.py reads windows
of it through numpy.memmap. The command line (distrain/cli/data.py) calls :func:`prepare`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from distrain.data import sources
from distrain.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer, parse_bpe_spec
from distrain.errors import ConfigError

FORMAT = "distrain.shards/1"
META_FILE = "meta.json"
DEFAULT_SHARD_TOKENS = 100_000_000
CHUNK_BYTES = sources.CHUNK_BYTES  # encode in ~1 MiB pieces (see the module docstring)


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


# --------------------------------------------------------------------------- inputs
def input_files(inputs: Sequence[str]) -> list[Path]:
    """The files of the text inputs among ``inputs`` (``shakespeare``, .txt files, folders), in order."""
    return [src.path for src in sources.sources(inputs) if src.kind == "text"]


def file_pieces(path: Path, chunk_bytes: int = CHUNK_BYTES, encoding: str = "utf-8") -> Iterator[bytes]:
    """The UTF-8 bytes of text file ``path`` (plus a final ``\n`` when missing) in pieces cut by the rule
    above (lines that ``encoding`` does not decode left out: data/sources.py)."""
    src = sources.Source(Path(path), "text", Path(path).stat().st_size)
    blocks = sources.byte_blocks(src, "", sources.BadRecords(), chunk_bytes, encoding)
    for piece, _ in sources.pieces(blocks, chunk_bytes):
        if piece:
            yield piece


def _source_pieces(src: sources.Source, text_field: str, bad: sources.BadRecords, encoding: str
                   ) -> Iterator[tuple[bytes, int]]:
    return sources.pieces(sources.byte_blocks(src, text_field, bad, CHUNK_BYTES, encoding), CHUNK_BYTES)


def _texts(srcs: Sequence[sources.Source], text_field: str, encoding: str) -> Iterator[str]:
    """Every source's text, piece by piece (what a BPE is trained on; bad records are counted later)."""
    for src in srcs:
        for piece, _ in _source_pieces(src, text_field, sources.BadRecords(), encoding):
            if piece:
                yield piece.decode("utf-8", errors="replace")  # (valid UTF-8 but where a piece was cut mid-character)


# --------------------------------------------------------------------------- writing
class ShardWriter:
    """Appends token arrays to ``tokens-NNNNN.bin`` files of at most ``shard_tokens`` each."""

    def __init__(self, folder: Path, dtype: np.dtype, shard_tokens: int):
        self.folder, self.dtype, self.shard_tokens = folder, dtype, shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0  # written so far
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
            self.tokens += int(part.size)

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


def _encode_files(tok: Tokenizer, srcs: Sequence[sources.Source], text_field: str, bad: sources.BadRecords,
                    writer: ShardWriter, progress: bool, encoding: str = "utf-8") -> None:
    """Tokenize every source into ``writer``; one progress bar per source (bytes of a text or JSON lines
    file, rows of a Parquet or Arrow one), with the tokens per second written so far."""
    from tqdm.auto import tqdm

    limit = tok.vocab_size
    for src in srcs:
        unit = "B" if src.kind in ("text", "jsonl") else " rows"
        bar = tqdm(total=src.total, unit=unit, unit_scale=src.kind in ("text", "jsonl"), disable=not progress,
                   desc=f"{src.path.name} ({tok.spec})", dynamic_ncols=True)
        t0, n0 = time.perf_counter(), writer.tokens
        try:
            batch, units = [], 0
            for piece, n in _source_pieces(src, text_field, bad, encoding):
                units += n
                if piece:
                    batch.append(piece)
                if len(batch) == 8:
                    _encode_batch(tok, batch, writer, limit, src.path)
                    batch = []
                    bar.update(units)
                    units = 0
                    bar.set_postfix(tokens_per_s=f"{(writer.tokens - n0) / max(1e-9, time.perf_counter() - t0):,.0f}")
            if batch:
                _encode_batch(tok, batch, writer, limit, src.path)
            bar.update(units)
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
            shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False, progress: bool = True,
            text_field: str = "text", split: str = "train", strict: bool = False, encoding: str = "utf-8") -> dict:
    """Tokenize ``inputs`` into a shard folder ``out`` (see the module docstring); returns its meta.
    ``text_field``: the field of a .jsonl record or the column of a .parquet file or datasets folder that
    holds the text; ``split``: a DatasetDict folder's split; ``strict``: a bad record (a line that does not
    decode included) is an error; ``encoding``: the text and JSON-lines files' encoding (data/sources.py)."""
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ConfigError(f"--val-fraction must be in [0, 1), got {val_fraction}")
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise ConfigError(f"--shard-tokens must be a positive integer, got {shard_tokens!r}")
    out = Path(out).expanduser()
    check_out(out, overwrite)
    encoding = sources.check_encoding(encoding)
    bpe = parse_bpe_spec(tokenizer)  # a malformed spec fails before any work
    srcs = sources.sources(inputs, split)
    source_bytes = sum(src.path.stat().st_size if src.path.is_file() else sum(f.stat().st_size for f in src.files)
                       for src in srcs)
    if all(src.total == 0 for src in srcs):
        raise ConfigError(f"distrain data prepare: the inputs {list(inputs)} hold no text (every file is empty)")
    bad = sources.BadRecords(strict=strict)
    t0 = time.perf_counter()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.prepare-{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if bpe is not None:
            if progress:
                print(f"training a byte-level BPE of {bpe} tokens on {len(srcs)} source(s), {source_bytes:,} bytes")
            tok = load_tokenizer(tokenizer, _texts(srcs, text_field, encoding))
        else:
            tok = load_tokenizer(tokenizer)
        tok.save(tmp)
        dtype = token_dtype(tok.vocab_size)
        writer = ShardWriter(tmp, dtype, shard_tokens)
        try:
            _encode_files(tok, srcs, text_field, bad, writer, progress, encoding)
        finally:
            shards = writer.close()
        n = sum(s["tokens"] for s in shards)
        if n == 0:
            raise ConfigError(f"distrain data prepare: the inputs {list(inputs)} gave no token ({bad.count} bad "
                              f"record(s){': ' + bad.named[0] if bad.named else ''})")
        seconds = time.perf_counter() - t0
        n_val = math.floor(n * val_fraction)
        spec = tok.spec if bpe is not None or tokenizer == "byte" else str(Path(tokenizer).expanduser().resolve())
        meta = {
            "format": FORMAT, "vocab_size": tok.vocab_size, "dtype": dtype.name, "fingerprint": tok.fingerprint,
            "tokenizer": {"spec": spec, "vocab_size": tok.vocab_size, "file": "tokenizer.json",
                          "fingerprint": tok.fingerprint},
            "tokens": n, "shards": shards,
            "splits": {"train": {"start": 0, "tokens": n - n_val}, "val": {"start": n - n_val, "tokens": n_val}},
            "val_fraction": val_fraction, "shard_tokens": shard_tokens, "encoding": encoding,
            "sources": [str(src.path) for src in srcs], "source_bytes": source_bytes,
            "bad_records": {"count": bad.count, "named": bad.named}, "seconds": seconds, "tokens_per_s": n / seconds,
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
