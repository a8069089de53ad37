"""Token shards: tokenizers, `distrain data prepare`, memmap windows, training on --data DIR, generate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from distrain.data import ShardDataset, load_corpus_bytes, load_shard_datasets, load_tokenizer, split_bytes
from distrain.data import prepare as prep
from distrain.data.shards import read_meta, shard_tokenizer
from distrain.errors import ConfigError, DistrainError
from distrain.trainer import train
from distrain.trainer.metrics import read_metrics

from conftest import trainer_config

WORDS = ("the king and queen of night shall speak to thee my lord good morrow sweet love "
         "what is this thing that comes upon us here ROMEO JULIET — café naïve 日本").split()


def make_corpus(folder: Path, n_files: int = 2, words: int = 3000, seed: int = 0) -> Path:
    """A few .txt files of pseudo-English lines (one without a final newline, one nested)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        lines, n = [], 0
        while n < words:
            k = int(rng.integers(3, 12))
            indent = "  " if rng.random() < 0.2 else ""
            lines.append(indent + " ".join(rng.choice(WORDS, k)) + rng.choice([".", ",", "!", ""]))
            n += k
        text = "\n".join(lines) + ("" if i == 0 else "\n")  # file 0 lacks its final newline
        sub = folder / ("nested" if i == 1 else "")
        sub.mkdir(exist_ok=True)
        (sub / f"part{i}.txt").write_text(text, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return make_corpus(tmp_path_factory.mktemp("corpus") / "text")


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory, corpus) -> Path:
    out = tmp_path_factory.mktemp("shards") / "bpe300"
    prep.prepare([str(corpus)], "bpe:300", out, val_fraction=0.1, shard_tokens=4000, progress=False)
    return out


def stream(folder: Path) -> np.ndarray:
    meta = read_meta(folder)
    parts = [np.fromfile(folder / s["file"], dtype=meta["dtype"]) for s in meta["shards"]]
    return np.concatenate(parts).astype(np.int64)


def one_line(e) -> str:
    msg = str(e.value) if hasattr(e, "value") else str(e)
    assert "\n" not in msg, msg
    return msg


# ============================================================================ tokenizers and prepare
def test_prepare_byte_is_the_text_bytes(tmp_path, corpus):
    out = tmp_path / "byte"
    meta = prep.prepare([str(corpus)], "byte", out, val_fraction=0.1, shard_tokens=1000, progress=False)
    data = load_corpus_bytes(corpus)  # data/text.py's corpus rule: the same bytes, the same split
    assert meta["tokens"] == len(data) and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert stream(out).tolist() == list(data)
    full, rest = divmod(len(data), 1000)
    assert [s["tokens"] for s in meta["shards"]] == [1000] * full + ([rest] if rest else [])
    train_b, val_b = split_bytes(data, 0.1)
    assert meta["splits"] == {"train": {"start": 0, "tokens": len(train_b)},
                              "val": {"start": len(train_b), "tokens": len(val_b)}}
    files = [s["file"] for s in meta["shards"]]
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "tokenizer.json"] + files
    tok = shard_tokenizer(out)
    text = "To be, or not — 日本\n"
    assert tok.decode(tok.encode(text)) == text and tok.encode(text) == list(text.encode())
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary folder left


def test_prepare_bpe_matches_the_tokenizers_library(tmp_path, corpus, bpe_dir, monkeypatch):
    from tokenizers import Tokenizer as HF

    meta = read_meta(bpe_dir)
    assert meta["vocab_size"] == 300 and meta["tokenizer"]["spec"] == "bpe:300" and meta["dtype"] == "uint16"
    import hashlib

    assert meta["fingerprint"] == hashlib.sha256((bpe_dir / "tokenizer.json").read_bytes()).hexdigest()
    hf = HF.from_file(str(bpe_dir / "tokenizer.json"))
    files = prep.input_files([str(corpus)])
    texts = [f.read_text(encoding="utf-8") for f in files]
    texts = [t if t.endswith("\n") else t + "\n" for t in texts]
    want = [i for t in texts for i in hf.encode(t, add_special_tokens=False).ids]
    assert stream(bpe_dir).tolist() == want  # each file encoded whole by the library directly
    assert meta["tokens"] == len(want) and sum(s["tokens"] for s in meta["shards"]) == len(want)
    assert len(meta["shards"]) == math.ceil(len(want) / 4000)
    n_val = math.floor(len(want) * 0.1)
    assert meta["splits"]["val"] == {"start": len(want) - n_val, "tokens": n_val}
    tok = shard_tokenizer(bpe_dir)
    assert tok.vocab_size == 300 and tok.decode(tok.encode(texts[1])) == texts[1]
    assert tok.encode("the king") == hf.encode("the king", add_special_tokens=False).ids
    assert max(want) >= 256  # merges were learnt
    # deterministic, and encoding a long file in pieces gives the whole file's ids
    monkeypatch.setattr(prep, "CHUNK_BYTES", 97)
    again = tmp_path / "again"
    m2 = prep.prepare([str(corpus)], "bpe:300", again, shard_tokens=10**6, progress=False)
    assert m2["fingerprint"] == meta["fingerprint"] and stream(again).tolist() == want
    assert len(list(prep.file_pieces(files[1], 97))) > 10
    # an HF tokenizer folder gives the same ids, recorded by its path
    m3 = prep.prepare([str(corpus)], str(bpe_dir), tmp_path / "hf", progress=False)
    assert stream(tmp_path / "hf").tolist() == want and m3["tokenizer"]["spec"] == str(bpe_dir.resolve())
    assert load_tokenizer("byte").vocab_size == 256 and load_tokenizer(str(bpe_dir)).vocab_size == 300


def test_get_batch_equals_slicing_the_tokens(bpe_dir):
    s = stream(bpe_dir)
    meta = read_meta(bpe_dir)
    rng = np.random.default_rng(1)
    for split in ("train", "val"):
        lo, n = meta["splits"][split]["start"], meta["splits"][split]["tokens"]
        for block, stride in ((16, None), (7, 3)):
            ds = ShardDataset(bpe_dir, split, block, stride)
            st = stride or block
            assert len(ds) == (n - block - 1) // st + 1
            idx = rng.integers(0, len(ds), 40)
            idx[:2] = [0, len(ds) - 1]
            x, y = ds.get_batch(torch.from_numpy(idx))
            assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (40, block)
            want = np.stack([s[lo + i * st: lo + i * st + block + 1] for i in idx])
            assert x.tolist() == want[:, :-1].tolist() and y.tolist() == want[:, 1:].tolist()
            xi, yi = ds[int(idx[5])]
            assert xi.tolist() == want[5, :-1].tolist()
    # windows that span two shard files (shards of 4000 tokens, windows of 17)
    ds = ShardDataset(bpe_dir, "train", 16)
    i = 4000 // 16
    assert ds.get_batch([i])[0].tolist()[0] == s[i * 16: i * 16 + 16].tolist() and (i * 16 + 17) > 4000
    with pytest.raises(IndexError):
        ds.get_batch([len(ds)])
    train_ds, val_ds = load_shard_datasets(bpe_dir, 16)
    assert train_ds.tokens + val_ds.tokens == meta["tokens"]


def test_large_vocabularies_are_stored_as_uint32(tmp_path, bpe_dir):
    assert prep.token_dtype(65536) == np.uint16 and prep.token_dtype(65537) == np.uint32
    d = tmp_path / "u32"
    d.mkdir()
    tokens = np.random.default_rng(0).integers(0, 100_000, 1000).astype(np.uint32)
    tokens[:300].tofile(d / "a.bin")
    tokens[300:].tofile(d / "b.bin")
    meta = dict(read_meta(bpe_dir), vocab_size=100_000, dtype="uint32", tokens=1000,
                shards=[{"file": "a.bin", "tokens": 300}, {"file": "b.bin", "tokens": 700}],
                splits={"train": {"start": 0, "tokens": 900}, "val": {"start": 900, "tokens": 100}})
    (d / "meta.json").write_text(json.dumps(meta))
    ds = ShardDataset(d, "train", 10)
    x, y = ds.get_batch([29, 30, 0])  # window 29 spans a.bin and b.bin
    assert x[0].tolist() == tokens[290:300].tolist() and y[0].tolist() == tokens[291:301].tolist()
    assert x[1].tolist() == tokens[300:310].tolist() and int(x.max()) >= 65536


# ============================================================================ training on --data DIR
@pytest.mark.timeout(120)
def test_shard_run_ddp_equals_one_process_and_takes_the_vocabulary(tmp_path, bpe_dir):
    from distrain.checkpoint.reshard import consolidate

    one = trainer_config(tmp_path / "one", data=str(bpe_dir), strategy="single", nproc=1)
    two = trainer_config(tmp_path / "two", data=str(bpe_dir), strategy="ddp", nproc=2)
    train(one)
    train(two)
    a = [r["loss"] for r in read_metrics(tmp_path / "one" / "metrics.jsonl")]
    b = [r["loss"] for r in read_metrics(tmp_path / "two" / "metrics.jsonl")]
    assert len(a) == len(b) == 5
    torch.testing.assert_close(torch.tensor(b), torch.tensor(a), rtol=1e-11, atol=0)
    assert a[0] == pytest.approx(math.log(300), rel=0.1)  # a 300-way softmax at the start
    form = consolidate(tmp_path / "two")
    emb = [t for n, t in form["model"].items() if t.dim() == 2 and t.shape[0] == 300]
    assert emb, "the preset was not built with the data's vocabulary of 300"
    record = json.loads((tmp_path / "two" / "data.json").read_text())
    assert record["fingerprint"] == read_meta(bpe_dir)["fingerprint"]
    assert (tmp_path / "two" / "tokenizer.json").is_file()


@pytest.mark.timeout(120)
def test_shard_run_resumes_exactly(tmp_path, bpe_dir):
    kw = dict(data=str(bpe_dir), strategy="ddp", nproc=2, dtype="float32")
    full = trainer_config(tmp_path / "full", steps=6, **kw)
    train(full)
    train(trainer_config(tmp_path / "part", steps=3, **kw))  # its final checkpoint: step 3 of 6
    train(trainer_config(tmp_path / "part", steps=6, resume=True, **kw))
    a = [r["loss"] for r in read_metrics(tmp_path / "full" / "metrics.jsonl")]
    b = [r["loss"] for r in read_metrics(tmp_path / "part" / "metrics.jsonl")]
    assert len(a) == 6 and a == b  # bit-identical (float32)


@pytest.mark.timeout(120)
def test_generate_prints_a_continuation(tmp_path, bpe_dir, capsys):
    import shutil

    from distrain.cli import main

    data, run = tmp_path / "shards", tmp_path / "run"
    shutil.copytree(bpe_dir, data)
    summary = train(trainer_config(run, data=str(data), strategy="single", nproc=1, steps=2, sample_chars=12))
    tok = load_tokenizer(str(data))  # the run's own sample decodes with the data's tokenizer: ids up to 299
    assert tok.decode(tok.encode(summary["sample"])) == summary["sample"] and summary["sample"].startswith("\n")
    capsys.readouterr()
    argv = ["generate", str(run), "--prompt", "the king", "--max-new-tokens", "12", "--seed", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("the king") and len(out.rstrip("\n")) > len("the king")
    shutil.rmtree(data)  # the shard folder gone: the run's copy of its tokenizer.json decodes, the same way
    assert main(argv) == 0
    assert capsys.readouterr().out == out  # and the seed fixes the sample


# ============================================================================ errors: one line, the file, the fix
def test_prepare_refuses_a_non_empty_out_and_leaves_nothing_on_failure(tmp_path, corpus, monkeypatch, capsys):
    from distrain.cli import main

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as e:
        prep.prepare([str(corpus)], "byte", out, progress=False)
    assert f"--out {out} is not empty (notes.txt)" in one_line(e) and "--overwrite" in str(e.value)
    with pytest.raises(ConfigError) as e:  # --overwrite replaces a shard folder only
        prep.prepare([str(corpus)], "byte", out, overwrite=True, progress=False)
    assert "not a shard folder" in one_line(e) and (out / "notes.txt").read_text() == "mine"
    shards = tmp_path / "shards"
    assert main(["data", "prepare", str(corpus), "--tokenizer", "byte", "--out", str(shards), "--no-progress"]) == 0
    assert main(["data", "prepare", str(corpus), "--tokenizer", "byte", "--out", str(shards), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"distrain: error: --out {shards} is not empty") and "\n" not in err
    first = read_meta(shards)
    prep.prepare([str(corpus)], "bpe:300", shards, overwrite=True, progress=False)
    assert read_meta(shards)["fingerprint"] != first["fingerprint"]

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(prep, "_encode_files", boom)
    with pytest.raises(RuntimeError):
        prep.prepare([str(corpus)], "byte", tmp_path / "never", progress=False)
    with pytest.raises(RuntimeError):
        prep.prepare([str(corpus)], "byte", shards, overwrite=True, progress=False)
    assert not (tmp_path / "never").exists() and read_meta(shards)["vocab_size"] == 300  # the old set intact
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "shards"]  # no temporary folder left
    for spec, frag in (("bpe:x", "integer"), ("bpe:100", "at least 256"), ("nope", "not byte, bpe:VOCAB")):
        with pytest.raises(ConfigError, match=frag):
            prep.prepare([str(corpus)], spec, tmp_path / "bad", progress=False)


def test_missing_or_truncated_shard_file_is_refused(tmp_path, corpus):
    d = tmp_path / "d"
    prep.prepare([str(corpus)], "byte", d, shard_tokens=5000, progress=False)
    cfg = trainer_config(tmp_path / "run", data=str(d))
    cfg.validate()
    f = d / "tokens-00001.bin"
    data = f.read_bytes()
    f.write_bytes(data[:-2])
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert f"shard file {f} has" in one_line(e) and "truncated" in str(e.value) and "--overwrite" in str(e.value)
    f.unlink()
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    msg = one_line(e)
    assert f"shard file {f} (listed in {d / 'meta.json'}) is missing" in msg
    assert f"distrain data prepare INPUT... --tokenizer SPEC --out {d} --overwrite" in msg


def test_a_vocabulary_larger_than_the_model_is_refused(tmp_path, bpe_dir):
    from distrain.models import GPT, GPTConfig
    from distrain.trainer.task import check_model_vocab

    model = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16))
    cfg = trainer_config(tmp_path / "run", data=str(bpe_dir), model="custom", strategy="single", nproc=1)
    with pytest.raises(ConfigError) as e:
        check_model_vocab(cfg, model)
    msg = one_line(e)
    assert f"--data {bpe_dir}: its tokenizer (bpe:300, {bpe_dir / 'meta.json'}) has vocab_size 300" in msg
    assert "vocab_size 256" in msg and "vocab_size >= 300" in msg
    # through distrain.train with your own model: refused before the first step
    cfg = trainer_config(tmp_path / "run", data=str(bpe_dir), strategy="single", nproc=1)
    with pytest.raises(DistrainError, match="has vocab_size 300 but --model custom has vocab_size 256"):
        train(cfg, model=model)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(120)
def test_resume_on_a_shard_folder_from_another_tokenizer_is_refused(tmp_path, corpus):
    d = tmp_path / "d"
    prep.prepare([str(corpus)], "byte", d, progress=False)
    train(trainer_config(tmp_path / "run", data=str(d), strategy="single", nproc=1, steps=2))
    prep.prepare([str(corpus)], "bpe:300", d, overwrite=True, progress=False)
    with pytest.raises(ConfigError) as e:
        train(trainer_config(tmp_path / "run", data=str(d), strategy="single", nproc=1, steps=4, resume=True))
    msg = one_line(e)
    assert f"--resume: shard folder {d} was tokenized with bpe:300" in msg
    assert f"trained on byte" in msg and str(tmp_path / "run" / "data.json") in msg and "another --out" in msg


def _sparse_shards(out: Path, tokens: int, shard: int = 500_000_000) -> Path:
    """A shard set of ``tokens`` zero ids (byte vocabulary) as sparse files: its size on disk is nothing,
    its windows are real (the sampler and the memory maps see ``tokens`` of them)."""
    import hashlib

    out.mkdir()
    stub = json.dumps({"type": "distrain.byte", "vocab_size": 256})
    (out / "tokenizer.json").write_text(stub)
    fp, shards = hashlib.sha256(stub.encode()).hexdigest(), []
    for k, a in enumerate(range(0, tokens, shard)):
        n = min(shard, tokens - a)
        with open(out / f"tokens-{k:05d}.bin", "wb") as f:
            f.truncate(2 * n)  # uint16
        shards.append({"file": f"tokens-{k:05d}.bin", "tokens": n})
    nv = tokens // 100
    (out / "meta.json").write_text(json.dumps({
        "format": "distrain.shards/1", "vocab_size": 256, "dtype": "uint16", "fingerprint": fp,
        "tokenizer": {"spec": "byte", "vocab_size": 256, "file": "tokenizer.json", "fingerprint": fp},
        "tokens": tokens, "shards": shards,
        "splits": {"train": {"start": 0, "tokens": tokens - nv}, "val": {"start": tokens - nv, "tokens": nv}}}))
    return out


def _ranks_peak_rss(cfg) -> list[int]:
    """Train ``cfg`` and return every rank's peak VmHWM in MiB (polled from /proc every 0.1 s)."""
    import os
    import threading
    import time

    peak: dict[str, int] = {}

    def descendants() -> list[str]:
        kids: dict[int, list[str]] = {}
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                kids.setdefault(int(open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[1]), []).append(p)
            except (OSError, IndexError, ValueError):
                pass
        out, todo = [], [os.getpid()]
        while todo:
            for c in kids.get(todo.pop(), []):
                out.append(c)
                todo.append(int(c))
        return out

    def poll(stop: threading.Event) -> None:
        while not stop.is_set():
            for p in descendants():
                try:
                    st = dict(line.split(":", 1) for line in open(f"/proc/{p}/status"))
                    peak[p] = max(peak.get(p, 0), int(st["VmHWM"].split()[0]) // 1024)
                except (OSError, KeyError, ValueError):
                    pass
            time.sleep(0.1)

    stop = threading.Event()
    th = threading.Thread(target=poll, args=(stop,), daemon=True)
    th.start()
    try:
        train(cfg)
    finally:
        stop.set()
        th.join()
    return sorted(v for v in peak.values() if v > 250)[-cfg.nproc:]  # the ranks (the fork server is smaller)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rank_memory_is_flat_in_the_corpus_size(tmp_path):
    """One rank's peak RSS on a 2.6 GB token set (1.3 G tokens) is within 50 MiB of its peak on 4 MB: the
    sampler computes each step's positions of the epoch's order (data/sampler.py FeistelPermutation)
    instead of keeping a permutation of every window (it took 150 MiB at this size)."""
    peaks = {}
    for name, tokens in (("small", 2_000_000), ("large", 1_300_000_000)):
        data = _sparse_shards(tmp_path / name, tokens)
        peaks[name] = _ranks_peak_rss(trainer_config(tmp_path / f"run-{name}", data=str(data), model="gpt-small",
                                                     nproc=2, strategy="ddp", steps=10, batch_size=32,
                                                     dtype="float32", timeout=200))
    assert len(peaks["small"]) == len(peaks["large"]) == 2, peaks
    assert max(peaks["large"]) - max(peaks["small"]) < 50, peaks
