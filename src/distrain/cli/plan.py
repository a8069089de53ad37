"""``distrain plan``: every strategy for a model on a cluster, ranked by predicted step time.

    distrain plan --model gpt-small --nodes 4 --procs-per-node 2 --link eth-1g

The flags name the model (a preset, or ``--params N`` with ``--compute-ms``), the cluster
(nodes x ranks per node, link presets or a ``bench link`` calibration) and the batch; the
model of step time, memory and traffic is :mod:`distrain.costmodel.plan` (docs/cost_model.md).
"""

from __future__ import annotations

import argparse
import dataclasses

from distrain.costmodel.links import INTRA, LINKS, Fabric, block_placement, calibrated_fabric
from distrain.errors import ConfigError


def add_parser(sub) -> None:
    """``distrain plan`` on the subparsers ``sub``."""
    p = sub.add_parser("plan", help="rank DDP/PS/dp x tp x pp strategies for a model on a cluster by predicted step time")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Predicted step time, memory and busiest-link bytes of every strategy; see docs/cost_model.md."
    p.add_argument("--model", default="gpt-small", help="a model preset (default gpt-small)")
    p.add_argument("--params", type=int, default=None, help="plan for N parameters instead (DDP/PS only)")
    p.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    p.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (default 1)")
    p.add_argument("--link", default="eth-1g", help=f"between nodes: {', '.join(LINKS)} (default eth-1g)")
    p.add_argument("--intra", default="shm", help=f"within a node: {', '.join(INTRA)} (default shm)")
    p.add_argument("--calibration", default=None, help="use a `distrain bench link --json` file for the links instead")
    p.add_argument("--batch-size", type=int, default=32, help="global batch (default 32)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches (default 8)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (default: the preset's block size; the shape-only Llama presets' is "
                        "their 8192-token context, whose s^2 attention term dominates the activation estimate)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="forward+backward of the global batch on one process; default: measured here (presets)")


def run(args: argparse.Namespace) -> int:
    from distrain.costmodel.plan import Compute, format_plans, measured_compute, model_spec, plans

    if args.nodes < 1 or args.procs_per_node < 1 or args.batch_size < 1 or args.microbatches < 1:
        raise ConfigError("--nodes, --procs-per-node, --batch-size and --microbatches must be >= 1")
    m = model_spec(None if args.params else args.model, args.params)
    if args.seq_len is not None:
        if args.seq_len < 1 or not m.hidden:
            raise ConfigError(f"--seq-len {args.seq_len}: give a positive length, for a transformer preset")
        m = dataclasses.replace(m, seq=args.seq_len)
    P = args.nodes * args.procs_per_node
    if P < 2:
        raise ConfigError("plan: give at least 2 ranks (--nodes x --procs-per-node)")
    placement = block_placement(P, args.procs_per_node)
    if args.calibration:
        fabric = calibrated_fabric(args.calibration, placement)
    else:
        if args.link not in LINKS or args.intra not in INTRA:
            raise ConfigError(f"--link must be one of {', '.join(LINKS)} and --intra one of {', '.join(INTRA)}")
        fabric = Fabric(placement, LINKS[args.link], INTRA[args.intra])
    if args.compute_ms is not None:
        c = Compute.linear(args.compute_ms / 1e3, args.batch_size)
    elif args.params:
        raise ConfigError("--params needs --compute-ms (forward+backward time of the global batch on one process)")
    else:
        c = measured_compute(args.model)
    rows = plans(m, fabric, c, args.batch_size, args.procs_per_node, args.microbatches)
    how = "given" if args.compute_ms is not None else f"measured here, AdamW {c.opt * m.params * 1e3:.1f} ms"
    print(f"# {m.name}: {m.params:,} parameters, batch {args.batch_size}, forward+backward "
          f"{c.fb(args.batch_size) * 1e3:.1f} ms on one process ({how}); {args.nodes} node(s) x "
          f"{args.procs_per_node} = {P} ranks; link "
          f"{args.calibration or args.link} (intra {args.intra})")
    print(format_plans(rows))
    return 0
