"""`distrain data prepare` on the formats corpora come in: JSON lines, Parquet, a saved `datasets` folder.

Each gives, token for token, what the same documents give from a .txt file (one after another, each
ending with a newline), with the byte tokenizer and with a BPE one; bad records are skipped, counted
and named (or, with --strict, stop the run with their place); a DatasetDict folder gives its split.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from distrain.data import prepare as prep
from distrain.errors import ConfigError

from test_data_shards import bpe_dir, corpus, stream  # noqa: F401  (the fixtures and the token stream)

DOCS = ["the king and queen\nof night", "ROMEO: good morrow, sweet love\n", "", "café naïve 日本 — what is this",
        "  indented line\n\nand a blank one"] * 40


def _txt(folder: Path, docs: list[str]) -> Path:
    path = folder / "docs.txt"
    path.write_text("".join(d if d.endswith("\n") else d + "\n" for d in docs if d), encoding="utf-8")
    return path


def _jsonl(folder: Path, docs: list[str], field: str = "text", extra_lines: tuple[str, ...] = ()) -> Path:
    path = folder / "docs.jsonl"
    lines = [json.dumps({field: d, "id": i}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines[:5] + list(extra_lines) + lines[5:]) + "\n", encoding="utf-8")
    return path


def _parquet(folder: Path, docs: list, field: str = "text") -> Path:
    path = folder / "docs.parquet"
    pq.write_table(pa.table({field: docs, "n": list(range(len(docs)))}), path, row_group_size=37)
    return path


def _datasets(folder: Path, docs: list[str], dict_split: str | None = None) -> Path:
    import datasets

    ds = datasets.Dataset.from_dict({"text": docs})
    path = folder / "saved"
    if dict_split is None:
        ds.save_to_disk(str(path))
    else:
        datasets.DatasetDict({dict_split: ds, "other": datasets.Dataset.from_dict({"text": ["unused"]})}
                             ).save_to_disk(str(path))
    return path


def _tokens(inputs: list, tokenizer: str, out: Path, **kw) -> tuple[list[int], dict]:
    meta = prep.prepare([str(p) for p in inputs], tokenizer, out, progress=False, **kw)
    return stream(out).tolist(), meta


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "datasets"])
def test_records_give_the_tokens_of_the_same_text(tmp_path, bpe_dir, kind):  # noqa: F811
    src = {"jsonl": _jsonl, "parquet": _parquet, "datasets": _datasets}[kind](tmp_path, DOCS)
    for tokenizer in ("byte", str(bpe_dir)):
        want, _ = _tokens([_txt(tmp_path, DOCS)], tokenizer, tmp_path / f"txt-{Path(tokenizer).name}")
        got, meta = _tokens([src], tokenizer, tmp_path / f"{kind}-{Path(tokenizer).name}")
        assert got == want and meta["bad_records"] == {"count": 0, "named": []}
        assert meta["tokens_per_s"] > 0 and meta["sources"] == [str(src)]


def test_records_stream_in_pieces_as_one_text(tmp_path, bpe_dir, monkeypatch):  # noqa: F811
    # small pieces: a source is cut at pre-token boundaries many times, the ids stay those of the whole text
    monkeypatch.setattr(prep, "CHUNK_BYTES", 97)
    want, _ = _tokens([_txt(tmp_path, DOCS)], str(bpe_dir), tmp_path / "txt")
    got, _ = _tokens([_jsonl(tmp_path, DOCS)], str(bpe_dir), tmp_path / "jsonl")
    assert got == want


def test_bad_records_are_skipped_counted_and_named_or_stop_with_strict(tmp_path):
    path = _jsonl(tmp_path, DOCS, extra_lines=("{not json", json.dumps({"body": "no text field"}),
                                               json.dumps({"text": 42}), json.dumps(["a", "list"])))
    got, meta = _tokens([path], "byte", tmp_path / "lenient")
    want, _ = _tokens([_txt(tmp_path, DOCS)], "byte", tmp_path / "txt")
    assert got == want
    assert meta["bad_records"]["count"] == 4
    assert meta["bad_records"]["named"] == [
        f"{path}:6: not a JSON object",
        f"{path}:7: no field 'text' (it has body); name the text field with --text-field",
        f"{path}:8: field 'text' is int, not a string",
        f"{path}:9: a JSON list, not an object with a 'text' field"]
    with pytest.raises(ConfigError) as e:
        prep.prepare([str(path)], "byte", tmp_path / "strict", progress=False, strict=True)
    assert str(e.value) == (f"distrain data prepare: {path}:6: not a JSON object; fix the record, or drop --strict to "
                            f"skip bad records (they are counted and named)")
    assert not (tmp_path / "strict").exists()
    pq_path = _parquet(tmp_path, ["a text", None, "another"])
    _, meta = _tokens([pq_path], "byte", tmp_path / "pq")
    assert meta["bad_records"] == {"count": 1, "named": [f"{pq_path}:row 0:1: field 'text' is NoneType, not a string"]}


def test_undecodable_bytes_are_bad_records_and_encoding_decodes_them(tmp_path, bpe_dir, capsys):  # noqa: F811
    # a Latin-1 file: line 2 holds 0xe9 (é) at byte 20 of the file and 0xef (ï) after it; lines 1 and 3 are ASCII
    from distrain.cli import main

    text = "plain ascii\ncafe caf\u00e9 na\u00efve\nthe end\n"
    path = tmp_path / "latin.txt"
    path.write_bytes(text.encode("latin-1"))
    for tokenizer in ("byte", str(bpe_dir)):
        got, meta = _tokens([path], tokenizer, tmp_path / f"lenient-{Path(tokenizer).name}")
        assert meta["bad_records"] == {"count": 1, "named": [
            f"{path}:2: byte offset 20: 0xe9 is not utf-8; give its encoding with --encoding (e.g. latin-1)"]}
        assert prep.load_tokenizer(tokenizer).decode(got) == "plain ascii\nthe end\n"  # the bad line is skipped
        fixed, meta = _tokens([path], tokenizer, tmp_path / f"latin-{Path(tokenizer).name}", encoding="latin-1")
        assert meta["bad_records"] == {"count": 0, "named": []} and meta["encoding"] == "iso8859-1"
        assert prep.load_tokenizer(tokenizer).decode(fixed) == text  # stored as UTF-8: the text is right
    with pytest.raises(ConfigError) as e:
        prep.prepare([str(path)], "byte", tmp_path / "strict", progress=False, strict=True)
    assert str(e.value) == (f"distrain data prepare: {path}:2: byte offset 20: 0xe9 is not utf-8; give its encoding "
                            f"with --encoding (e.g. latin-1); fix the record, or drop --strict to skip bad records "
                            f"(they are counted and named)")
    assert sorted(p.name for p in tmp_path.iterdir() if "strict" in p.name) == []  # nothing half-written
    # a JSON-lines file in Latin-1: the same rule, per line
    jl = tmp_path / "latin.jsonl"
    jl.write_bytes(b'{"text": "ok"}\n' + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
    got, meta = _tokens([jl], "byte", tmp_path / "jl")
    assert bytes(got) == b"ok\n" and meta["bad_records"]["named"] == [
        f"{jl}:2: byte offset 28: 0xe9 is not utf-8; give its encoding with --encoding (e.g. latin-1)"]
    assert bytes(_tokens([jl], "byte", tmp_path / "jl1", encoding="latin-1")[0]) == "ok\ncaf\u00e9\n".encode()
    # the command line: --encoding, the bad record in the summary, and an encoding that is not ASCII-compatible
    assert main(["data", "prepare", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[1] == (
        f"1 bad record(s) skipped (--strict stops at the first); {path}:2: byte offset 20: 0xe9 is not utf-8; give "
        f"its encoding with --encoding (e.g. latin-1)")
    assert main(["data", "prepare", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "cli1"),
                 "--encoding", "latin-1", "--no-progress"]) == 0
    assert bytes(stream(tmp_path / "cli1").tolist()) == text.encode("utf-8")
    for enc, why in (("klingon", "not a text encoding Python knows"), ("utf-16", "its line break is not the byte")):
        assert main(["data", "prepare", str(path), "--tokenizer", "byte", "--out", str(tmp_path / "cli2"),
                     "--encoding", enc, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert why in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "cli2").exists()


def test_the_text_field_and_the_split_are_chosen(tmp_path, capsys):
    from distrain.cli import main

    want, _ = _tokens([_txt(tmp_path, DOCS)], "byte", tmp_path / "txt")
    got, _ = _tokens([_jsonl(tmp_path, DOCS, field="content")], "byte", tmp_path / "content", text_field="content")
    assert got == want
    saved = _datasets(tmp_path, DOCS, dict_split="train")
    assert _tokens([saved], "byte", tmp_path / "dict")[0] == want
    with pytest.raises(ConfigError, match=r"holds the splits \['train', 'other'\], not 'test'; choose one with --split"):
        prep.prepare([str(saved)], "byte", tmp_path / "nope", progress=False, split="test")
    with pytest.raises(ConfigError, match=r"has no column 'body' \(its columns: text, n\); name the text column"):
        prep.prepare([str(_parquet(tmp_path, DOCS))], "byte", tmp_path / "nope", progress=False, text_field="body")
    # the command line: the flags, and the one-line summary with the bad records
    src = _jsonl(tmp_path, DOCS[:5], field="body", extra_lines=("{",))
    assert main(["data", "prepare", str(src), "--text-field", "body", "--tokenizer", "byte", "--out",
                 str(tmp_path / "cli"), "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"{tmp_path / 'cli'}: ") and "tokens/s" in out[0]
    assert out[1] == f"1 bad record(s) skipped (--strict stops at the first); {src}:6: not a JSON object"
    assert main(["data", "prepare", str(src), "--tokenizer", "byte", "--out", str(tmp_path / "cli2"), "--strict",
                 "--no-progress"]) == 2
    assert "no field 'text' (it has body, id); name the text field with --text-field" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_stays_flat_in_the_size_of_a_jsonl(tmp_path):
    """Peak RSS of `distrain data prepare` on a 1 MB and a 200 MB .jsonl (byte tokenizer) differ by < 50 MiB."""
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    words = np.array("the king queen night speak lord morrow sweet love what thing comes".split())
    line = json.dumps({"text": " ".join(rng.choice(words, 200))}) + "\n"
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_text(line * (1_000_000 // len(line)))
    with open(big, "w") as f:
        for _ in range(200):
            f.write(line * (1_000_000 // len(line)))
    peaks = {}
    for name, path in (("small", small), ("big", big)):
        code = ("import resource, sys; from distrain.data.prepare import prepare; "
                f"prepare([{str(path)!r}], 'byte', {str(tmp_path / name)!r}, progress=False); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
        peaks[name] = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                         timeout=250).stdout.split()[-1]) / 1024  # KiB -> MiB
    assert peaks["big"] - peaks["small"] < 50, peaks
