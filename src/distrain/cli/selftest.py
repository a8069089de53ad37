"""``distrain selftest``: every way of training checked against one process, then throughput on GPUs.

    distrain selftest                      # CPU: Gloo and shm; with CUDA devices: NCCL, then tokens/s and MFU
    distrain selftest --only ddp,tp2 --transports gloo --keep --out runs/st

It works in a temporary folder, removed at the end (the table is the result); ``--keep`` keeps the
runs and selftest.json in ``--out`` instead.

The work is :func:`distrain.selftest.run`; this module parses the flags and prints its table.
The exit status is 1 when a check fails (a skipped check does not fail).
"""

from __future__ import annotations

import argparse
import tempfile

from distrain.errors import ConfigError

KEPT = "runs/selftest"  # --keep's folder when --out is left out


def add_parser(sub) -> None:
    """``distrain selftest`` on the subparsers ``sub``."""
    p = sub.add_parser("selftest", help="check every strategy against one process on this machine (Gloo and shm; "
                                        "NCCL and throughput with GPUs); writes a JSON and a table")
    p.description = ("Train llama-small for 5 fp64 steps with every strategy and layout and compare each loss with "
                     "the single-process CPU run; on CUDA devices also measure tokens/s and MFU of a "
                     "Llama-3.2-1B-shaped model in bf16. At most about 8 minutes.")
    p.add_argument("--keep", action="store_true", help="keep the runs and selftest.json in --out (without it the "
                                                        "self-test works in a temporary folder and leaves nothing)")
    p.add_argument("--out", default=None, help="with --keep: the folder for the runs and selftest.json (default "
                                               f"{KEPT})")
    p.add_argument("--only", default=None, help="comma-separated checks to run (default: all of them)")
    p.add_argument("--transports", default=None, help="CPU only: comma-separated gloo, shm (default both)")
    p.add_argument("--no-throughput", action="store_true", help="skip the GPU throughput runs")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from distrain import selftest

    names = [n for n, _ in selftest.CHECKS]
    only = args.only.split(",") if args.only else None
    bad = [n for n in only or [] if n not in names]
    if bad:
        raise ConfigError(f"--only {','.join(bad)}: no such check; choose from {', '.join(names)}")
    transports = args.transports.split(",") if args.transports else None
    if transports and any(t not in ("gloo", "shm") for t in transports):
        raise ConfigError(f"--transports {args.transports}: choose from gloo, shm")
    if args.out is not None and not args.keep:
        raise ConfigError(f"--out {args.out}: the self-test keeps its runs only with --keep (without it, it works in "
                          f"a temporary folder and leaves nothing); add --keep")
    if args.keep:
        out = args.out or KEPT
        result = selftest.run(out, only=only, transports=transports, throughput_runs=not args.no_throughput)
    else:
        with tempfile.TemporaryDirectory(prefix="distrain-selftest-") as out:
            result = selftest.run(out, only=only, transports=transports, throughput_runs=not args.no_throughput)
    print(selftest.format_table(result))
    if args.keep:
        print(f"# {out}/selftest.json")
    return 0 if result["passed"] else 1
