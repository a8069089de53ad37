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
                   help="shakespeare (the packaged corpus), a .txt file, or a folder of .txt files; several are "
                        "concatenated in order")
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
                   shard_tokens=args.shard_tokens, overwrite=args.overwrite, progress=args.progress)
    sp = meta["splits"]
    print(f"{args.out}: {meta['tokens']:,} tokens ({meta['dtype']}, vocabulary {meta['vocab_size']}, "
          f"{meta['tokenizer']['spec']}) in {len(meta['shards'])} shard(s); train {sp['train']['tokens']:,}, "
          f"val {sp['val']['tokens']:,}; train on it with `distrain train --data {args.out}`")
    return 0
