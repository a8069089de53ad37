"""``distrain bench cp-memory|activation-memory|predict|step-predict``: the studies whose results the
documents quote (docs/context_parallel.md, docs/training.md, docs/cost_model.md), run by hand.

Like the tools of :mod:`distrain.cli.bench`, each is ``add_TOOL_arguments(parser)`` and
``run_TOOL(args)``, which turns the flags into typed values and calls the study's ``run`` in
distrain/bench/; :data:`TOOLS` is what ``distrain bench`` registers.
"""

from __future__ import annotations

import argparse

from distrain.bench import common
from distrain.errors import ConfigError


def add_cp_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (the model's block size is set to it)")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--cp", default="2,4", help="cp sizes, comma-separated (one process always runs)")
    p.add_argument("--algorithms", default="ring,all-to-all", help="ring and/or all-to-all, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="timed steps per layout (median)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: cpu_count // N)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every layout, order rotated; median step time")
    p.add_argument("--json", default=None, help="write the rows here")


def run_cp_memory(args: argparse.Namespace) -> int:
    from distrain.bench.train import cp_memory

    algorithms = common.parse_choices(args.algorithms, ("ring", "all-to-all"), "--algorithms")
    return cp_memory.run(args.model, common.parse_int(args.seq, "--seq", 1), common.parse_int(args.batch, "--batch", 1),
                         tuple(common.parse_ints(args.cp, "--cp", 2)), tuple(algorithms), common.parse_int(args.reps, "--reps", 1),
                         common.parse_int(args.threads, "--threads", 0), common.parse_int(args.rounds, "--rounds", 1), args.json)


def add_activation_memory_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--reps", type=int, default=3, help="timed steps per variant (median)")
    p.add_argument("--json", default=None, help="write the rows here")


def run_activation_memory(args: argparse.Namespace) -> int:
    from distrain.bench.train import activation_memory

    return activation_memory.run(args.model, common.parse_int(args.layers, "--layers", 1), common.parse_int(args.batch, "--batch", 1),
                                 common.parse_int(args.reps, "--reps", 1), args.json)


# -- predict, step-predict
def add_predict_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("The records of `distrain bench comm --predict --json` runs: with --table/--plot/--size their "
                     "Markdown table and a figure of measured against predicted by node count; with --repredict "
                     "LINK.json the cost model's predictions again, in place (after a model change).")
    p.add_argument("records", nargs="+", help="bench comm --json files")
    p.add_argument("--table", default=None, help="write the Markdown table here")
    p.add_argument("--plot", default=None, help="write the figure here (PNG)")
    p.add_argument("--size", default="4M", help="message size of the figure (default 4M)")
    p.add_argument("--repredict", default=None, metavar="LINK_JSON",
                   help="predict every record again from this bench link calibration")


def run_predict(args: argparse.Namespace) -> int:
    from distrain.bench.comm import predict

    if args.repredict:
        if args.table or args.plot:
            raise ConfigError("bench predict: --repredict rewrites the records; give --table/--plot in another run")
        predict.repredict(args.repredict, args.records)
        return 0
    if not (args.table and args.plot):
        raise ConfigError("bench predict: give --table OUT.md and --plot OUT.png (or --repredict LINK.json)")
    return predict.write_table(args.table, args.plot, common.parse_size(args.size), args.records)


def add_step_predict_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("calibration", help="a distrain bench link --json file of the same cluster")
    p.add_argument("link", help="the link's name in the table (e.g. 200mbit)")
    p.add_argument("runs", nargs="+", help="distrain train --out folders")


def run_step_predict(args: argparse.Namespace) -> int:
    from distrain.bench.train import step_predict

    return step_predict.run(args.calibration, args.link, args.runs)


TOOLS = (
    ("cp-memory", "context parallelism on one long sequence: activations, peak memory, time and bytes per rank",
     add_cp_memory_arguments, run_cp_memory),
    ("activation-memory", "memory kept for backward with and without activation checkpointing (one process)",
     add_activation_memory_arguments, run_activation_memory),
    ("predict", "bench comm records with --predict: their table and figure, or the predictions again",
     add_predict_arguments, run_predict),
    ("step-predict", "measured step time of distrain train run folders beside distrain plan's prediction",
     add_step_predict_arguments, run_step_predict),
)
