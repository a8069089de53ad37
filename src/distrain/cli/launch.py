"""``distrain launch``: run a script (or ``train ...``) on many ranks, torchrun underneath.

    distrain launch --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] script.py ARGS

The flags take torchrun's spellings too (``--nproc_per_node``); the work is
:func:`distrain.launch.launch`.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """``distrain launch`` on the subparsers ``sub``."""
    p = sub.add_parser("launch", help="run a script on many ranks (torchrun underneath)", allow_abbrev=False)
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None,
                   help="ranks on this node, torchrun's --nproc-per-node (default: the --nproc of a `train` job)")
    p.add_argument("--nnodes", default="1", help="number of nodes (or MIN:MAX for elastic jobs)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's index")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT reachable by every node")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the job on failure; `train` jobs then resume from their newest checkpoint")
    p.add_argument("--rdzv-id", "--rdzv_id", default="distrain",
                   help="the rendezvous's job id, the same on every node (default distrain)")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="script.py and its arguments, or `train ...` / `-- distrain train ...`")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from distrain.launch import launch

    return launch(args.nproc_per_node, args.script, nnodes=args.nnodes, node_rank=args.node_rank,
                  rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts, rdzv_id=args.rdzv_id)
