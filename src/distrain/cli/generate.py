"""``distrain generate RUN --prompt "..."``: sample text from a run's final checkpoint.

    distrain generate runs/bpe --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 0
    distrain generate runs/smollm --prompt "Once" --top-p 0.9 --use-transformers
    distrain generate runs/mine --model mypkg.nets:make_net --prompt "Once"   # a run of your own factory

Prints the prompt followed by the sampled continuation; the work (the run's model and
tokenizer, the sampling) is :func:`distrain.generate.generate_text`.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """``distrain generate`` on the subparsers ``sub``."""
    p = sub.add_parser("generate", help="sample text from a run's final checkpoint with its tokenizer (a preset, "
                                        "hf:DIR or PKG.MOD:FACTORY run)")
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
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: among the fewest likeliest tokens whose probability reaches p, after "
                        "--top-k; 1: no cut (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling: the same seed, the same text "
                                                       "(default: %(default)s)")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="recompute the whole context for every token instead of using the KV cache of distrain's "
                        "GPT and Llama (the same text, slower; for comparison)")
    p.add_argument("--model", default=None, metavar="PKG.MOD:FACTORY",
                   help="the run's --model, named again: needed for a run of your own factory, which distrain never "
                        "imports because a checkpoint names it (a preset or hf:DIR run needs none)")
    p.add_argument("--use-transformers", action="store_true",
                   help="sample with Hugging Face transformers' generate instead of distrain's sampler: Llama runs "
                        "(llama-tiny, llama-small, hf:DIR) and factories returning a transformers model")


def run(args: argparse.Namespace) -> int:
    from distrain.generate import generate_text

    print(generate_text(args.run, args.prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_k=args.top_k, seed=args.seed, top_p=args.top_p, use_cache=args.use_cache,
                        use_transformers=args.use_transformers, model=args.model))
    return 0
