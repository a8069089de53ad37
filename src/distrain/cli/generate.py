"""``distrain generate RUN --prompt "..."``: sample text from a run's final checkpoint.

    distrain generate runs/bpe --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0

Prints the prompt followed by the sampled continuation; the work (the run's model and
tokenizer, the sampling) is :func:`distrain.generate.generate_text`.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """``distrain generate`` on the subparsers ``sub``."""
    p = sub.add_parser("generate", help="sample text from a run's final checkpoint with its tokenizer")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="a training run's folder (its --out, holding checkpoint.json)")
    p.add_argument("--prompt", default="\n", help="the text to continue (default: a newline)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="softmax temperature; 0 = greedy (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=40, help="sample among the k likeliest tokens; 0: all "
                                                         "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    from distrain.generate import generate_text

    print(generate_text(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed))
    return 0
