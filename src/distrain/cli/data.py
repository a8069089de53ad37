"""``distrain data prepare``: text files -> a token shard folder for ``distrain train --data DIR``.

    distrain data prepare shakespeare --tokenizer bpe:2048 --out data/shakespeare-bpe2048

The work, the folder's format and its rules are :func:`distrain.data.prepare.prepare`'s
(docs/data.md); this module parses the flags and prints the one-line summary.
"""

from __future__ import annotations

import argparse

from distrain.data.prepare import DEFAULT_SHARD_TOKENS, prepare


def add_parser(sub) -> None:
    """``distrain data prepare`` on the subparsers ``sub``."""
    p = sub.add_parser("data", help="tokenize text into token shards for `train --data DIR` (docs/data.md)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    q = sub.add_parser("prepare", help="tokenize text files into token shards (numpy.memmap-readable) for --data",
                       description="Tokenize text into a shard folder; train on it with `distrain train --data DIR`. "
                                   "See docs/data.md.")
    q.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="shakespeare (the packaged corpus), a .txt file, a folder of .txt files, a .jsonl or .parquet "
                        "file, or a folder saved by Hugging Face datasets (save_to_disk); several are concatenated "
                        "in order")
    q.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field (.jsonl) or column (.parquet, datasets folder) holding the text (default: "
                        "%(default)s)")
    q.add_argument("--split", default="train", help="the split of a saved DatasetDict folder (default: %(default)s)")
    q.add_argument("--strict", action="store_true",
                   help="stop at the first bad record (not JSON, no text field, not a string, a line that does not "
                        "decode) instead of skipping it; skipped records are counted and the first few named")
    q.add_argument("--encoding", default="utf-8", metavar="ENC",
                   help="the encoding of the .txt and .jsonl inputs, e.g. latin-1 or cp1252 (default: %(default)s); "
                        "a line that does not decode is a bad record")
    q.add_argument("--tokenizer", required=True, metavar="SPEC",
                   help="byte (ids = bytes, 256), bpe:VOCAB (train a byte-level BPE on the inputs), or a folder "
                        "holding a Hugging Face tokenizer.json")
    q.add_argument("--out", required=True, metavar="DIR", help="the shard folder to write (must be new or empty)")
    q.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of the tokens kept for validation (default: %(default)s)")
    q.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help="tokens per shard file (default: %(default)s)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing shard folder at --out")
    q.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="show a progress bar")


def run(args: argparse.Namespace) -> int:
    meta = prepare(args.inputs, args.tokenizer, args.out, val_fraction=args.val_fraction,
                   shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=args.progress,
                   text_field=args.text_field, split=args.split, strict=args.strict, encoding=args.encoding)
    sp, bad = meta["splits"], meta["bad_records"]
    print(f"{args.out}: {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']}, "
          f"{meta['tokenizer']['spec']}) in {len(meta['shards'])} shard(s), {meta['tokens_per_s']:,.0f} tokens/s; "
          f"train {sp['train']['tokens']:,}, val {sp['val']['tokens']:,}; train on it with `distrain train --data "
          f"{args.out}`")
    if bad["count"]:
        print(f"{bad['count']} bad record(s) skipped (--strict stops at the first); " + "; ".join(bad["named"]))
    return 0
