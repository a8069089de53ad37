"""``distrain secret``: print a new job secret (64 hex characters) for a job over several machines.

    export DISTRAIN_JOB_SECRET=$(distrain secret)    # then the same value on every node

Every node of one job needs the same secret in ``DISTRAIN_JOB_SECRET`` (distrain.sealed: the job's
stores are sealed with it); a job of one machine makes its own and needs nothing.
"""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """``distrain secret`` on the subparsers ``sub``."""
    p = sub.add_parser("secret", help="print a new job secret for DISTRAIN_JOB_SECRET (the same on every node of a "
                                      "multi-node job)")
    p.description = ("Print 32 random bytes as 64 hex characters. Give every node of a job over several machines the "
                     "same value in DISTRAIN_JOB_SECRET: the job's stores are sealed with it (docs/security.md). A "
                     "job of one machine makes its own.")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from distrain import sealed

    print(sealed.new())
    return 0
