"""``distrain bench wan``: DDP against the DiLoCo forms across an emulated slow WAN (docs/slow_links.md).

Like the tools of :mod:`distrain.cli.bench`, ``add_wan_arguments(parser)`` declares the flags and
``run_wan(args)`` turns them into :class:`distrain.bench.wan.runs.Settings` and runs it; :data:`TOOLS`
is what ``distrain bench`` registers.
"""

from __future__ import annotations

import argparse

from distrain.bench import common
from distrain.bench.wan import runs

DEFAULTS = runs.Settings()


def add_wan_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Train the same job (model, data, steps, batch, seed: the same tokens) with DDP and with "
                     "DiLoCo's forms across an emulated cluster of slow links (a cluster of its own, one rank per "
                     "node), and compare validation loss at equal tokens, bytes sent per node, wall time to DDP's "
                     "final loss and compute utilisation. Needs root. See docs/slow_links.md.")
    p.add_argument("--nodes", type=int, default=DEFAULTS.nodes, help=f"nodes, one rank each (default {DEFAULTS.nodes})")
    p.add_argument("--link", default=DEFAULTS.link, help=f"every node's link rate (default {DEFAULTS.link})")
    p.add_argument("--delay", default=DEFAULTS.delay,
                   help=f"every node's one-way delay: two nodes are 2x apart round trip (default {DEFAULTS.delay})")
    p.add_argument("--strategies", default=",".join(DEFAULTS.strategies),
                   help=f"comma-separated, ddp among them (its final loss is the target), from "
                        f"{', '.join(runs.STRATEGIES)} (default {','.join(DEFAULTS.strategies)})")
    p.add_argument("--model", default=DEFAULTS.model, help=f"a preset or PKG.MOD:FACTORY, as for train "
                                                           f"(default {DEFAULTS.model})")
    p.add_argument("--data", default=DEFAULTS.data, help=f"as for train (default {DEFAULTS.data})")
    p.add_argument("--steps", type=int, default=DEFAULTS.steps,
                   help=f"steps of every run, a multiple of --inner-steps (default {DEFAULTS.steps})")
    p.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size,
                   help=f"global batch of every run (default {DEFAULTS.batch_size})")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed, help=f"model and data seed (default {DEFAULTS.seed})")
    p.add_argument("--lr", type=float, default=None, help="learning rate (DiLoCo's inner one) (default: train's)")
    p.add_argument("--inner-steps", type=int, default=DEFAULTS.inner_steps,
                   help=f"DiLoCo's H, for every diloco form (default {DEFAULTS.inner_steps})")
    p.add_argument("--outer-lr", type=float, default=None,
                   help="DiLoCo's outer learning rate, for every diloco form (default: train's)")
    p.add_argument("--outer-momentum", type=float, default=None,
                   help="DiLoCo's outer momentum, for every diloco form (default: train's)")
    p.add_argument("--warm-start", type=int, default=DEFAULTS.warm_start, metavar="S",
                   help="first train ddp S steps across the cluster; every strategy starts from its weights "
                        f"(--init-from), as the DiLoCo paper does (default {DEFAULTS.warm_start}: from scratch)")
    p.add_argument("--target-budget", type=int, default=DEFAULTS.target_budget, metavar="F",
                   help="every strategy but ddp trains F x --steps, so that its wall time to ddp's final loss is "
                        "measured where it needs more tokens; the loss at equal tokens is still its evaluation "
                        f"after --steps (default {DEFAULTS.target_budget}: the same steps as ddp)")
    p.add_argument("--eval-every", type=int, default=DEFAULTS.eval_every,
                   help=f"steps between validations: the curves' points (default {DEFAULTS.eval_every})")
    p.add_argument("--eval-batches", type=int, default=DEFAULTS.eval_batches,
                   help=f"validation batches per point (default {DEFAULTS.eval_batches})")
    p.add_argument("--name", default=DEFAULTS.name, help=f"the cluster's name (default {DEFAULTS.name})")
    p.add_argument("--timeout", type=float, default=DEFAULTS.timeout,
                   help=f"seconds one run may take (default {DEFAULTS.timeout:g})")
    p.add_argument("--out", default=None, help="keep the run folders here, one per strategy (default: removed)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records and metadata as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write the figure (PNG): validation loss against tokens and wall time, bytes per node")


def run_wan(args: argparse.Namespace) -> int:
    strategies = tuple(common.split_csv(args.strategies, "--strategies"))
    runs.run(runs.Settings(
        nodes=args.nodes, link=args.link, delay=args.delay, strategies=strategies, model=args.model, data=args.data,
        steps=args.steps, batch_size=args.batch_size, seed=args.seed, lr=args.lr, inner_steps=args.inner_steps,
        outer_lr=args.outer_lr, outer_momentum=args.outer_momentum, warm_start=args.warm_start,
        target_budget=args.target_budget, eval_every=args.eval_every, eval_batches=args.eval_batches,
        name=args.name, timeout=args.timeout, out=args.out, json_path=args.json, plot_path=args.plot))
    return 0


TOOLS = (("wan", "DDP against DiLoCo (float32, int8, int4) across an emulated slow WAN: loss, bytes, time to loss",
          add_wan_arguments, run_wan),)
