"""Tokenizers: bytes, a byte-level BPE trained on your corpus, or a Hugging Face ``tokenizer.json``.

``load_tokenizer(spec, files=None)`` understands three specs:

* ``byte``: ids are the UTF-8 bytes of the text (vocabulary 256), what ``data/text.py``
  trains on; ``decode`` replaces invalid UTF-8 with U+FFFD.
* ``bpe:VOCAB``: a byte-level BPE (GPT-2 style: ``ByteLevel`` pre-tokenizer without a prefix
  space, every one of the 256 bytes in the initial alphabet, no special tokens) trained with
  the ``tokenizers`` library on ``files`` up to ``VOCAB`` entries (``VOCAB >= 256``).
  Training is deterministic: the same files give the same ``tokenizer.json``, byte for byte.
* a folder holding ``tokenizer.json`` (or the path of that file): a Hugging Face tokenizer,
  read with ``tokenizers.Tokenizer.from_file``. Special tokens are never added by ``encode``.

Every tokenizer has ``encode(str) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``spec``, ``save(dir)`` (writes ``dir/tokenizer.json``), ``to_json()`` (that file's text) and
``fingerprint`` (the sha256 of that text). ``Tokenizer.load(dir)`` reads one back. The byte
tokenizer's ``tokenizer.json`` is a two-key stub, ``{"type": "distrain.byte", "vocab_size":
256}``, not a Hugging Face file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Iterable, Sequence, Union

from distrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
BYTE_STUB = {"type": "distrain.byte", "vocab_size": 256}
SPEC_HELP = "byte, bpe:VOCAB (e.g. bpe:8192) or a folder holding a Hugging Face tokenizer.json"

PathLike = Union[str, "os.PathLike[str]"]


class Tokenizer:
    """The interface every tokenizer here has (see the module docstring)."""

    spec: str
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        raise NotImplementedError

    def to_json(self) -> str:
        raise NotImplementedError

    @property
    def fingerprint(self) -> str:
        """sha256 of the ``tokenizer.json`` text: two tokenizers with one fingerprint give the same ids."""
        return hashlib.sha256(self.to_json().encode("utf-8")).hexdigest()

    def save(self, folder: PathLike) -> Path:
        path = Path(folder) / TOKENIZER_FILE
        path.write_text(self.to_json(), encoding="utf-8")
        return path

    @staticmethod
    def load(folder: PathLike) -> "Tokenizer":
        """The tokenizer saved in ``folder`` (or the ``tokenizer.json`` file itself)."""
        path = Path(folder)
        if path.is_dir():
            path = path / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError(f"tokenizer file {path} not found (a shard folder or a Hugging Face model folder holds "
                              f"one); give {SPEC_HELP}")
        text = path.read_text(encoding="utf-8")
        try:
            head = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"tokenizer file {path} is not JSON ({e}); re-create it") from None
        if isinstance(head, dict) and head.get("type") == BYTE_STUB["type"]:
            return ByteTokenizer()
        return HFTokenizer.from_str(text, spec=str(path.parent.resolve()), where=str(path))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """ids = UTF-8 bytes (vocabulary 256)."""

    spec = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def decode(self, ids: Sequence[int]) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ConfigError(f"byte tokenizer: ids must be in [0, 256), got {bad[0]}; the ids come from a model "
                              f"with a larger vocabulary: decode them with its data's tokenizer")
        return bytes(ids).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        return json.dumps(BYTE_STUB)


class HFTokenizer(Tokenizer):
    """A ``tokenizers.Tokenizer`` (trained here or read from a ``tokenizer.json``)."""

    def __init__(self, tok, spec: str):
        self.tok = tok
        self.spec = spec
        vocab = tok.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0  # ids may have holes: the embedding needs max + 1

    @classmethod
    def from_str(cls, text: str, spec: str, where: str = "<string>") -> "HFTokenizer":
        from tokenizers import Tokenizer as _Tok

        try:
            tok = _Tok.from_str(text)
        except Exception as e:  # noqa: BLE001 - the library raises plain Exceptions
            raise ConfigError(f"tokenizer file {where} cannot be read by the tokenizers library ({e}); give "
                              f"{SPEC_HELP}") from None
        return cls(tok, spec)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        fast = getattr(self.tok, "encode_batch_fast", None)  # tokenizers >= 0.20: the same ids, no offsets
        return [e.ids for e in (fast or self.tok.encode_batch)(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.tok.to_str()


# --------------------------------------------------------------------------- BPE training
def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """A byte-level BPE of ``vocab_size`` entries trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer as _Tok
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256:
        raise ConfigError(f"--tokenizer bpe:{vocab_size}: a byte-level BPE needs a vocabulary of at least 256 (every "
                          f"byte is a token); use e.g. bpe:8192")
    tok = _Tok(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, f"bpe:{vocab_size}")


def parse_bpe_spec(spec: str) -> int | None:
    """``bpe:VOCAB`` -> VOCAB; None for another spec; ConfigError for a malformed one."""
    if not spec.startswith("bpe:"):
        return None
    n = spec[4:]
    if not n.isdigit():
        raise ConfigError(f"--tokenizer {spec}: the vocabulary size must be an integer, e.g. bpe:8192")
    return int(n)


def load_tokenizer(spec: str, texts: Iterable[str] | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names (see the module docstring). ``bpe:VOCAB`` trains on ``texts``
    (an iterable of strings: chunks of the corpus)."""
    spec = str(spec)
    if spec == "byte":
        return ByteTokenizer()
    vocab = parse_bpe_spec(spec)
    if vocab is not None:
        if texts is None:
            raise ConfigError(f"--tokenizer {spec} is trained on the input files: give them (distrain data prepare "
                              f"INPUT... --tokenizer {spec})")
        return train_bpe(texts, vocab)
    p = Path(spec).expanduser()
    if p.is_dir() or p.is_file():
        return Tokenizer.load(p)
    raise ConfigError(f"--tokenizer {spec!r}: not byte, bpe:VOCAB, nor an existing folder holding tokenizer.json; "
                      f"give {SPEC_HELP}")
