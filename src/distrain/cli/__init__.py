"""The ``distrain`` command: subcommands map onto library calls.

    distrain launch --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] script.py ARGS
    distrain train --nproc 2 --strategy ddp --algorithm ring --model gpt-small --data shakespeare
    distrain bench comm --nproc 4 --ops all_reduce --algorithms native,ring --sizes 4K,4M
    distrain data prepare shakespeare --tokenizer bpe:2048 --out data/bpe   # then train --data data/bpe
    distrain generate runs/latest --prompt "ROMEO:" --max-new-tokens 200
    distrain secret                                   # a job secret for DISTRAIN_JOB_SECRET (several nodes)

Every command's argument parsing lives in this package, one module per command (launch, train,
cluster, plan, bench, checkpoint, data, generate, selftest, secret), each with ``add_parser(subparsers)``, which
declares the command's flags and sets ``func``, the function that turns the parsed flags into
typed arguments of a library call; the library modules do not parse ``argv``. common.py holds
the exit codes and the one-line error. Only the entry points import this package: ``distrain``
(pyproject's console script, :func:`run_command`, which puts the current folder on ``sys.path`` as
``python -m`` does), ``python -m distrain`` and
``python -m distrain.cli`` (how launched ranks start).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

from distrain.cli import common
from distrain.errors import DistrainError
from distrain.launch.rank_exit import exit_status

__all__ = ["build_parser", "exit_status", "main", "run_command"]


# every command's module, in the order of --help
COMMANDS = ("launch", "train", "cluster", "plan", "bench", "checkpoint", "data", "generate", "selftest", "secret")


def build_parser(commands: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    """The ``distrain`` parser with ``commands`` (default all). :func:`main` builds only the command it
    runs: importing every command's module imports torch, which ``--version``, ``cluster up|down|status|link``
    and ``data prepare`` do not need (about 1.7 s of CPU per process on the 2-core host)."""
    import importlib

    from distrain import __version__

    parser = argparse.ArgumentParser(prog="distrain", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"distrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in commands:
        importlib.import_module(f"distrain.cli.{command}").add_parser(sub)
    return parser


def _commands_of(argv: list[str]) -> tuple[str, ...]:
    """The commands :func:`main` needs in its parser for ``argv``: the one it names first, none for a
    lone ``--version``, else all (``--help``, a mistyped command: argparse lists them)."""
    if argv[:1] == ["--version"]:
        return ()
    return (argv[0],) if argv[:1] and argv[0] in COMMANDS else COMMANDS


def main(argv: list[str] | None = None) -> int:
    from distrain import entry, lifeline
    from distrain.cli.train import apply_config_file

    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_commands_of(argv))
    try:
        apply_config_file(parser, argv)
    except DistrainError as e:
        return common.error(e)
    args = parser.parse_args(argv)
    previous = {}
    try:
        if entry.launched_rank(os.environ) is None:  # the top process: SIGTERM/SIGHUP end the ranks, then us
            previous = lifeline.stop_on_signals()
        return args.func(args) or 0
    except DistrainError as e:
        return common.error(e)
    except KeyboardInterrupt:
        return common.interrupted()
    except lifeline.Stopped as e:
        return common.signalled(e)
    finally:
        lifeline.restore(previous)


def import_from_cwd() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m distrain`` does, so that the ``distrain``
    console script (whose ``sys.path[0]`` is its own bin folder) finds ``--model mypkg.nets:make_net`` beside
    ``mypkg/`` too; spawned ranks receive this ``sys.path``. ``python -P`` (safe_path) keeps it out."""
    here = os.getcwd()
    if not sys.flags.safe_path and here not in {os.path.abspath(p or os.curdir) for p in sys.path}:
        sys.path.insert(0, here)


def run_command(argv: list[str] | None = None) -> None:
    """``python -m distrain(.cli) ARGS``: :func:`main`, then exit with its status through
    :func:`distrain.entry.leave` (the exit handlers run, stdout and stderr flushed, no interpreter
    finalization). A launched rank (:func:`distrain.entry.launched_rank`) must skip finalization (see
    runtime); every other command skips it for speed: tearing down torch's modules cost 0.6 s of CPU
    after ``import torch`` and 1.1 s with torch._dynamo loaded, measured on the 2-core host, at the end of
    every command. A top process first waits for its non-daemon threads, as interpreter exit does."""
    from distrain import entry

    import_from_cwd()
    code = exit_status(main, argv)
    try:
        launched = entry.launched_rank(os.environ) is not None
    except DistrainError:  # RANK/WORLD_SIZE set but not integers: main said so; still a launcher's process
        launched = True
    if not launched:
        for t in threading.enumerate():
            if t is not threading.main_thread() and not t.daemon:
                t.join()
    entry.leave(code)
