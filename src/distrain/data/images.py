"""Image classification data: Fashion-MNIST (IDX files from Debian) and sklearn digits.

Both loaders return ``(train, test)`` :class:`ArrayDataset` objects with
``x``: float tensor of shape ``(N, 1, H, W)`` scaled to [0, 1] and
``y``: int64 class labels in ``[0, 10)``.

* Fashion-MNIST: ``apt-get update && apt-get install -y dataset-fashion-mnist``
  installs ``/usr/share/datasets/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz``
  (gzipped IDX). The IDX format is parsed here with numpy (:func:`read_idx`);
  uncompressed files are accepted too. Split: the official 60 000 / 10 000.
  Pixels are ``uint8 / 255``.
* Digits: scikit-learn's bundled digits (the file its ``load_digits`` reads, read here without
  importing scikit-learn; 1797 images of 8x8, values 0..16, scaled by ``/ 16``). Split rule: a permutation of the 1797 indices from
  ``numpy.random.default_rng(seed)``; the first ``N - floor(N * test_fraction)``
  permuted indices are train, the rest test (default 1438 / 359).
"""

from __future__ import annotations

import gzip
import math
import os
from pathlib import Path
from typing import Sequence, Union

import numpy as np
import torch

from distrain.errors import ConfigError

FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_INSTALL = "apt-get update && apt-get install -y dataset-fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                         "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")

PathLike = Union[str, "os.PathLike[str]"]
Indices = Union[torch.Tensor, np.ndarray, Sequence[int]]

# IDX type code -> numpy dtype (big-endian for multi-byte types)
_IDX_DTYPES = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(np.int16): 0x0B,
              np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D, np.dtype(np.float64): 0x0E}


# --------------------------------------------------------------------------- IDX
def parse_idx(buf: bytes, name: str = "<bytes>") -> np.ndarray:
    """Parse an (uncompressed) IDX byte string.

    Layout: 2 zero bytes, 1 byte type code (0x08 ubyte, 0x09 sbyte, 0x0B int16,
    0x0C int32, 0x0D float32, 0x0E float64), 1 byte number of dims ``d``, then
    ``d`` big-endian uint32 sizes, then the data, big-endian, C order.
    Returns an array in native byte order.
    """
    if len(buf) < 4:
        raise ConfigError(f"IDX file {name}: only {len(buf)} bytes, too short for the 4-byte magic number")
    if buf[0] != 0 or buf[1] != 0:
        raise ConfigError(f"IDX file {name}: bad magic number {buf[:4].hex()} (first two bytes must be 0)")
    code, ndim = buf[2], buf[3]
    if code not in _IDX_DTYPES:
        raise ConfigError(f"IDX file {name}: unknown type code 0x{code:02x}")
    header = 4 + 4 * ndim
    if len(buf) < header:
        raise ConfigError(f"IDX file {name}: truncated header ({len(buf)} bytes, need {header})")
    dims = tuple(int(d) for d in np.frombuffer(buf, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    count = int(np.prod(dims, dtype=np.int64)) if ndim else 1
    expected = header + count * dtype.itemsize
    if len(buf) != expected:
        raise ConfigError(f"IDX file {name}: dims {dims} of {dtype} need {expected} bytes, file has {len(buf)}")
    arr = np.frombuffer(buf, dtype=dtype, count=count, offset=header).reshape(dims)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def read_idx(path: PathLike) -> np.ndarray:
    """Read an IDX file, gzipped (detected by its 1f 8b magic) or not."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return parse_idx(raw, name=str(p))


def write_idx(path: PathLike, array: np.ndarray, compress: bool | None = None) -> Path:
    """Write ``array`` as IDX (gzipped when ``compress`` or the name ends in .gz)."""
    p = Path(path)
    a = np.asarray(array)
    dt = a.dtype.newbyteorder("=")
    if dt not in _IDX_CODES:
        raise ConfigError(f"write_idx: dtype {a.dtype} has no IDX type code")
    code = _IDX_CODES[dt]
    head = bytes([0, 0, code, a.ndim]) + np.asarray(a.shape, dtype=">u4").tobytes()
    body = a.astype(_IDX_DTYPES[code], copy=False).tobytes(order="C")
    data = head + body
    if compress or (compress is None and p.suffix == ".gz"):
        data = gzip.compress(data, mtime=0)
    p.write_bytes(data)
    return p


# --------------------------------------------------------------------------- dataset
class ArrayDataset(torch.utils.data.Dataset):
    """A TensorDataset-like pair ``(x, y)`` with a vectorized ``get_batch``."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, num_classes: int = 10, name: str = "data"):
        if len(x) != len(y):
            raise ConfigError(f"{name}: x has {len(x)} rows but y has {len(y)}")
        self.x = x
        self.y = y.long()
        self.num_classes = num_classes
        self.name = name

    @property
    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]

    def get_batch(self, indices: Indices) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(indices, torch.Tensor):
            idx = indices.to(dtype=torch.long, device="cpu").reshape(-1)
        else:
            idx = torch.as_tensor(np.asarray(indices, dtype=np.int64)).reshape(-1)
        return self.x[idx], self.y[idx]

    def to(self, dtype: torch.dtype) -> "ArrayDataset":
        """Same data with ``x`` cast to ``dtype`` (e.g. torch.float64)."""
        return ArrayDataset(self.x.to(dtype), self.y, self.num_classes, self.name)

    def __repr__(self) -> str:
        return f"ArrayDataset(name={self.name!r}, x={tuple(self.x.shape)} {self.x.dtype}, y={tuple(self.y.shape)})"


# --------------------------------------------------------------------------- Fashion-MNIST
def _find(root: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    return None


def load_fashion_mnist(root: PathLike | None = None, dtype: torch.dtype = torch.float32
                       ) -> tuple[ArrayDataset, ArrayDataset]:
    """(train 60000, test 10000); x ``(N, 1, 28, 28)`` in [0, 1], y int64.

    ``root`` defaults to /usr/share/datasets/fashion-mnist (the trainer passes ``$DISTRAIN_FASHION_MNIST``,
    read at the process edge: ``distrain.runtime.validate_args``).
    """
    root = Path(root if root is not None else FASHION_MNIST_ROOT)
    out = []
    for split in ("train", "t10k"):
        files = {kind: _find(root, f"{split}-{kind}-ubyte") for kind in ("images-idx3", "labels-idx1")}
        missing = [f"{split}-{k}-ubyte[.gz]" for k, v in files.items() if v is None]
        if missing:
            raise ConfigError(
                f"Fashion-MNIST not found in {str(root)!r} (missing {', '.join(missing)}); "
                f"install it with `{FASHION_MNIST_INSTALL}` (Debian), or pass root= a folder holding the IDX files"
            )
        images = read_idx(files["images-idx3"])
        labels = read_idx(files["labels-idx1"])
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise ConfigError(f"Fashion-MNIST {split}: unexpected shapes images {images.shape} labels {labels.shape}")
        x = torch.from_numpy(images).to(dtype).div_(255.0).unsqueeze(1)
        y = torch.from_numpy(labels.astype(np.int64))
        out.append(ArrayDataset(x, y, 10, name=f"fashion-mnist-{'train' if split == 'train' else 'test'}"))
    return out[0], out[1]


# --------------------------------------------------------------------------- digits
DIGITS_FILE = ("datasets", "data", "digits.csv.gz")  # inside the sklearn package: what its load_digits reads


def _digits_table() -> np.ndarray:
    """The rows of scikit-learn's bundled digits file, read as its ``load_digits`` reads them (``np.loadtxt``
    of the gzipped CSV) but without importing scikit-learn: that import takes about 2 s, in every rank of
    every job on digits. The file is checked (shape, labels, pixel range) like any input."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the digits data set needs scikit-learn: `pip install scikit-learn` (sklearn not found)")
    path = Path(list(spec.submodule_search_locations)[0]).joinpath(*DIGITS_FILE)
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",")
    except (OSError, ValueError, EOFError) as e:
        raise ConfigError(f"the digits data set {str(path)!r} is unreadable ({e}); reinstall it with "
                          f"`pip install --force-reinstall scikit-learn`") from None
    ok = (table.ndim == 2 and table.shape[1] == 65 and len(table) > 0 and table.min() >= 0
          and table[:, :64].max() <= 16 and set(np.unique(table[:, 64])) <= set(range(10)))
    if not ok:
        raise ConfigError(f"the digits data set {str(path)!r} is not 8x8 images of 0..16 with labels 0..9 (shape "
                          f"{table.shape}); reinstall it with `pip install --force-reinstall scikit-learn`")
    return table


def load_digits(test_fraction: float = 0.2, seed: int = 0, dtype: torch.dtype = torch.float32
                ) -> tuple[ArrayDataset, ArrayDataset]:
    """scikit-learn's digits: (train, test); x ``(N, 1, 8, 8)`` in [0, 1], y int64."""
    if not 0.0 < test_fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}")
    table = _digits_table()  # (1797, 65): 64 pixels (row-major 8x8, values 0..16), then the label
    images = table[:, :64].reshape(-1, 8, 8) / 16.0
    labels = table[:, 64].astype(np.int64)
    n = len(labels)
    perm = np.random.default_rng(seed).permutation(n)
    n_test = math.floor(n * test_fraction)
    tr, te = torch.from_numpy(perm[: n - n_test]), torch.from_numpy(perm[n - n_test:])
    x = torch.from_numpy(images).to(dtype).unsqueeze(1)
    y = torch.from_numpy(labels)
    return (ArrayDataset(x[tr], y[tr], 10, name="digits-train"),
            ArrayDataset(x[te], y[te], 10, name="digits-test"))
