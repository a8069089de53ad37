"""The ``distrain`` command: subcommands map onto library calls.

    distrain launch --nproc-per-node N [--nnodes M --node-rank R --rdzv-endpoint HOST:PORT] script.py ARGS
    distrain train --nproc 2 --strategy ddp --algorithm ring --model gpt-small --data shakespeare
    distrain bench comm --nproc 4 --ops all_reduce --algorithms native,ring --sizes 4K,4M
    distrain data prepare shakespeare --tokenizer bpe:2048 --out data/bpe   # then train --data data/bpe
    distrain generate runs/latest --prompt "ROMEO:" --max-new-tokens 200

Each subcommand module registers its own flags (``add_arguments(parser)``) and runs with
``run(args) -> int``; this file only wires them together.
"""

from __future__ import annotations

import argparse
import os
import sys

from distrain.errors import DistrainError
from distrain.launch.rank_exit import exit_status


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc_per_node", type=int, default=None,
                   help="ranks on this node, torchrun's --nproc-per-node (default: the --nproc of a `train` job)")
    p.add_argument("--nnodes", default="1", help="number of nodes (or MIN:MAX for elastic jobs)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this node's index")
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, help="HOST:PORT reachable by every node")
    p.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the job on failure; `train` jobs then resume from their newest checkpoint")
    p.add_argument("script", nargs=argparse.REMAINDER,
                   help="script.py and its arguments, or `train ...` / `-- distrain train ...`")


def _run_launch(args: argparse.Namespace) -> int:
    from distrain.launch import launch

    return launch(args.nproc_per_node, args.script, nnodes=args.nnodes, node_rank=args.node_rank,
                  rdzv_endpoint=args.rdzv_endpoint, max_restarts=args.max_restarts)


def _resume_value(v: str):
    """--resume (yes), --resume auto (if a checkpoint exists), --resume no."""
    low = v.lower()
    if low == "auto":
        return "auto"
    if low in ("yes", "true", "1"):
        return True
    if low in ("no", "false", "0"):
        return False
    raise argparse.ArgumentTypeError(f"--resume takes no value, or auto / yes / no; got {v!r}")


def _config_arguments(p: argparse.ArgumentParser, cls) -> None:
    """One flag per dataclass field (``batch_size`` -> ``--batch-size``): type from its default,
    help text and allowed values from its metadata (``trainer.config.opt``), so there is one source."""
    import dataclasses

    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        meta = f.metadata
        choices = meta.get("choices")
        help_text = meta.get("help", "") + (f" [{' | '.join(map(str, choices))}]" if choices else "")
        help_text += " (default: %(default)s)"
        if f.name == "resume":
            p.add_argument(flag, nargs="?", const=True, default=default, type=_resume_value, metavar="auto",
                           help=help_text)
            p.add_argument("--no-resume", dest="resume", action="store_false", default=default,
                           help="start afresh (the default)")
        elif f.name == "model" and cls.__name__ == "TrainConfig":  # left out: None, resolved by checkpoint/init_from.py
            p.add_argument(flag, default=None, metavar="MODEL", help=help_text.replace(
                "%(default)s", f"{default}; with --init-from or --resume: the checkpoint's model"))
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            kind = meta.get("type") or (type(default) if default is not None else str)
            p.add_argument(flag, type=kind, default=default, help=help_text,
                           metavar=f.name.upper())


def _run_train(args: argparse.Namespace) -> int:
    from distrain import runlock
    from distrain import checkpoint
    from distrain.checkpoint import init_from
    from distrain.trainer import TrainConfig, train

    cfg = TrainConfig(**{k: v for k, v in vars(args).items() if k not in ("command", "func", "config")})
    if cfg.resume is False and os.environ.get("DISTRAIN_RESUME") == "auto":  # set by launch --max-restarts
        cfg.resume = "auto"
    init_from.resolve(cfg)  # a left-out --model: the default, or --init-from's / --resume's checkpoint's
    cfg.validate()
    if not cfg.resume:
        init_from.check(cfg)  # --init-from's weights fit the model: refused before --out is made
    from distrain.elastic.nodes import follower

    # one rank of a launched job, or a node other than 0 of an elastic one: rank 0 / node 0 holds the lock
    if ("RANK" in os.environ and os.environ["RANK"] != "0") or (cfg.elastic and follower()):
        train(cfg)
        return 0
    with runlock.hold(cfg.out):
        checkpoint.clean_temporaries(cfg.out)  # left by a run killed mid-save; nobody else writes here now
        train(cfg)
    return 0


def _apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """``train --config run.toml``: the file's settings become the defaults, so flags override them."""
    import dataclasses

    from distrain.errors import ConfigError
    from distrain.trainer.config import TrainConfig

    if not argv or argv[0] != "train":
        return
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if path is None:
        return
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError("--config needs Python >= 3.11 (tomllib); give the settings as flags instead") from None
    try:
        with open(path, "rb") as f:
            settings = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--config {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: not valid TOML ({e})") from None
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    values = {}
    for key, value in settings.items():
        name = key.replace("-", "_")
        if name not in names:
            raise ConfigError(f"--config {path}: unknown setting {key!r}; settings are the train flags' names "
                              f"(e.g. batch-size or batch_size)")
        values[name] = value
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub.choices["train"].set_defaults(**values)


def build_parser() -> argparse.ArgumentParser:
    from distrain.bench.comm import collectives as comm_bench
    from distrain.bench.link import calibrate as link_bench
    from distrain.bench.pipeline import bubbles as pipeline_bench
    from distrain.bench.tp import blocks as tp_bench
    from distrain.bench.train import ps as ps_bench, throughput as train_bench, zero as zero_bench
    from distrain.cluster import cli as cluster_cli

    from distrain import __version__

    parser = argparse.ArgumentParser(prog="distrain", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"distrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("launch", help="run a script on many ranks (torchrun underneath)", allow_abbrev=False)
    _launch_arguments(p)
    p.set_defaults(func=_run_launch)

    from distrain.trainer.config import TrainConfig

    p = sub.add_parser("train", help="train a model: one process, DDP, torch DDP, dp x tp x pp or parameter servers",
                       description="Train a model on one or many processes; see docs/training.md.")
    p.add_argument("--config", metavar="RUN.toml", default=None,
                   help="read settings from a TOML file (keys: the flags' names); flags given here override it")
    _config_arguments(p, TrainConfig)
    p.set_defaults(func=_run_train)

    p = sub.add_parser("cluster", help="an emulated cluster on this host (netns + veth + tc) and runs across it")
    cluster_cli.add_arguments(p)

    from distrain.costmodel import plan as cost_plan

    p = sub.add_parser("plan", help="rank DDP/PS/dp x tp x pp strategies for a model on a cluster by predicted step time")
    cost_plan.add_arguments(p)
    p.set_defaults(func=cost_plan.run)

    bench = sub.add_parser("bench", help="benchmarks that compare ours with torch's, side by side")
    bsub = bench.add_subparsers(dest="bench", required=True)
    p = bsub.add_parser("comm", help="collective bandwidth: native vs star/ring/tree (nccl-tests style)")
    comm_bench.add_arguments(p)
    p.set_defaults(func=comm_bench.run)
    p = bsub.add_parser("link", help="ping-pong calibration of alpha and beta per link (for the cost model)")
    link_bench.add_arguments(p)
    p.set_defaults(func=link_bench.run)
    p = bsub.add_parser("ps", help="parameter-server round time (pull + push + update), beside the cost model")
    ps_bench.add_arguments(p)
    p.set_defaults(func=ps_bench.run)
    p = bsub.add_parser("train", help="training throughput: our DDP vs torch DDP vs parameter servers")
    train_bench.add_arguments(p)
    p.set_defaults(func=train_bench.run)
    p = bsub.add_parser("pipeline", help="pipeline bubble and activation peaks: GPipe, 1F1B, ZB-H1 against their formulas")
    pipeline_bench.add_pipeline_arguments(p)
    p.set_defaults(func=pipeline_bench.run_pipeline)
    p = bsub.add_parser("tp", help="tensor-parallel all-reduce bytes per block vs Megatron's count")
    tp_bench.add_tp_arguments(p)
    p.set_defaults(func=tp_bench.run_tp)
    p = bsub.add_parser("zero", help="memory per rank and step time: DDP, ZeRO-1/2/3 vs torch ZeRO-1 and FSDP2")
    zero_bench.add_arguments(p)
    p.set_defaults(func=zero_bench.run)
    from distrain.bench.train import layouts as layout_bench

    p = bsub.add_parser("layouts", help="every layout (ddp, zero3, tp, pp, dp x tp x pp) on one model: samples/s "
                                        "and peak memory per rank")
    layout_bench.add_arguments(p)
    p.set_defaults(func=layout_bench.run)
    from distrain.trainer import checkpoint_cli

    p = sub.add_parser("checkpoint", help="a run's sharded checkpoint as one plain state_dict file, and back; "
                                          "Hugging Face Llama folders in and out (--hf)")
    checkpoint_cli.add_arguments(p)
    p.set_defaults(func=checkpoint_cli.run)
    from distrain import generate_cli
    from distrain.data import prepare as data_prepare

    p = sub.add_parser("data", help="tokenize text into token shards for `train --data DIR` (docs/data.md)")
    data_prepare.add_arguments(p)
    p.set_defaults(func=data_prepare.run)
    p = sub.add_parser("generate", help="sample text from a run's final checkpoint with its tokenizer")
    generate_cli.add_arguments(p)
    p.set_defaults(func=generate_cli.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    from distrain import lifeline

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _apply_config_file(parser, argv)
    except DistrainError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    # the top process: SIGTERM/SIGHUP end the ranks, then us
    previous = lifeline.stop_on_signals() if "RANK" not in os.environ else {}
    try:
        return args.func(args) or 0
    except DistrainError as e:
        print(f"distrain: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("distrain: interrupted (Ctrl-C); every rank was stopped", file=sys.stderr)
        return 130
    except lifeline.Stopped as e:
        print(f"distrain: {e}; every rank was stopped", file=sys.stderr)
        return 128 + e.signum
    finally:
        lifeline.restore(previous)


def run_command(argv: list[str] | None = None) -> None:
    """``python -m distrain(.cli) ARGS``: :func:`main`, then exit with its status. A launched rank
    (RANK set) leaves through :func:`distrain.runtime.leave`, skipping interpreter finalization."""
    code = exit_status(main, argv)
    if "RANK" in os.environ:
        from distrain import runtime

        runtime.leave(code)
    sys.exit(code)


if __name__ == "__main__":
    run_command()
