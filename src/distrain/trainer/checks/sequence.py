"""--seq-len: the training sequence length of a causal language model, against the model's positions and the data.

The text is cut into blocks of ``seq_len`` tokens (the window rule of data/text.py and data/shards.py);
the model must have positions for them (its ``block_size``: a preset's, or an HF config's
``max_position_embeddings``). Left at 0, the model's own ``block_size`` is used, but at most
:data:`DEFAULT_SEQ_LEN` tokens: an HF config's context (131072 for Llama-3.2-1B) is the longest the
model can read, not a sensible training length. When the default is cut, ``cfg.seq_len`` is set to the
length chosen (halved further while the data holds fewer than ``--batch-size`` blocks of it) and one
note line says so; an explicit ``--seq-len`` is never changed, only refused, in one line, when the model
or the data cannot hold it. Your factory's model is checked once built (trainer/loop.py).
"""

from __future__ import annotations

import math
import os

from distrain.data.vocab import shard_folder
from distrain.trainer.checks.need import need

DEFAULT_SEQ_LEN = 2048  # the longest default training sequence (--seq-len sets any length the model holds)


def model_positions(cfg) -> int | None:
    """How many positions the model ``cfg.model`` has (its block_size): a preset's or an ``hf:`` Llama's;
    None for your own model (known once built)."""
    from distrain.checkpoint.models import is_hf_name
    from distrain.models import MODEL_PRESETS, preset_config

    if is_hf_name(cfg.model):
        from distrain.checkpoint import init_from

        return int(init_from.model_config(cfg)["block_size"])
    if cfg.model in MODEL_PRESETS:
        return preset_config(cfg.model).get("block_size")
    return None


def split_tokens(cfg) -> tuple[int, int] | None:
    """(train, val) tokens of --data when it is a shard folder or a text corpus (byte ids), else None."""
    if cfg.data_kind != "text":
        return None
    folder = shard_folder(cfg)
    if folder is not None:
        from distrain.data.shards import read_meta

        sp = read_meta(folder, check_files=False)["splits"]
        return int(sp["train"]["tokens"]), int(sp["val"]["tokens"])
    if cfg.data != "shakespeare" and not os.path.exists(cfg.data):
        return None  # (check_model_data says so)
    from distrain.data.text import corpus_files

    n = 0
    for f in corpus_files(None if cfg.data == "shakespeare" else cfg.data):
        size = f.stat().st_size
        if size:
            with open(f, "rb") as fh:
                fh.seek(size - 1)
                n += size + (fh.read(1) != b"\n")  # (text.py adds a final newline when missing)
    n_val = math.floor(n * 0.1)  # (text.py's split: val_fraction 0.1)
    return n - n_val, n_val


def _windows(tokens: int, t: int) -> int:
    return (tokens - t - 1) // t + 1 if tokens > t else 0


def check_seq_len(cfg, launched: tuple[int, int] | None = None) -> None:
    """--seq-len fits the model's positions and the data; the default is cut to DEFAULT_SEQ_LEN with a note
    (printed by the process that spawns the ranks, or rank 0 of a launched job)."""
    need(isinstance(cfg.seq_len, int) and not isinstance(cfg.seq_len, bool) and cfg.seq_len >= 0,
         f"--seq-len must be a non-negative integer (0: the model's block size, at most {DEFAULT_SEQ_LEN}), got "
         f"{cfg.seq_len!r}")
    positions = model_positions(cfg)
    if positions is None:  # your own model, or not a language model
        need(not cfg.seq_len or cfg.custom_model or cfg.data_kind == "text",
             f"--seq-len applies to language models on text; --model {cfg.model} reads {cfg.data}")
        return
    from distrain.trainer.choices import MODEL_DATA

    lm = cfg.model not in MODEL_DATA or MODEL_DATA[cfg.model] == "text"
    need(lm or not cfg.seq_len, f"--seq-len applies to language models on text; --model {cfg.model} reads "
                                f"{cfg.data}")
    if not lm:
        return
    need(cfg.seq_len <= positions,
         f"--seq-len {cfg.seq_len}: --model {cfg.model} has positions for {positions} tokens (its block size / "
         f"max_position_embeddings); give --seq-len {positions} or less")
    splits = split_tokens(cfg)
    if cfg.seq_len:
        t = cfg.seq_len
        why = f"--seq-len {t}"
    else:
        t = min(positions, DEFAULT_SEQ_LEN)
        if t < positions and splits is not None:  # the default: shorter still when the data is small
            while t > 1 and (_windows(splits[0], t) < cfg.batch_size or 0 < splits[1] < t + 1):
                t //= 2
        if t < positions:
            cfg.seq_len = t
            if launched is None or launched[0] == 0:
                print(f"note: --model {cfg.model} has {positions:,} positions; training on sequences of {t} tokens "
                      f"(set the length with --seq-len N)", flush=True)
        why = f"the sequence length {t} (--model {cfg.model}'s block size; set it with --seq-len N)"
    if cfg.cp > 1 and str(cfg.model).startswith("hf:"):  # (a preset's: checks/layout.py, with its block size)
        from distrain.parallel.context_parallel import check_length

        check_length(t, cfg.cp, why)  # 2 x cp equal chunks: refused here, not by every rank after the spawn
    if splits is None:
        return
    for name, n in zip(("train", "val"), splits):
        need(name == "val" and n == 0 or n >= t + 1,
             f"{why}: the {name} split of --data {cfg.data} has {n:,} tokens, fewer than one block of {t} + 1; give "
             f"a smaller --seq-len (at most {max(1, n - 1)}) or more text")
