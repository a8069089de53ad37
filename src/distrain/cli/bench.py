"""``distrain bench ps|train|pipeline|tp|zero|layouts|elastic``, with ``bench comm|link``
(:mod:`distrain.cli.bench_comm`), the studies of :mod:`distrain.cli.bench_studies` and ``bench wan``
(:mod:`distrain.cli.bench_wan`): every benchmark's flags.

    distrain bench comm --nproc 4 --ops all_reduce --algorithms native,ring --sizes 4K,4M
    distrain bench train --nproc 1,2,4 --strategies ddp,torch-ddp,ps-sync --model mlp

For each tool, ``add_TOOL_arguments(parser)`` declares its flags and ``run_TOOL(args)`` turns
them into typed values (comma lists into lists, sizes into bytes, ``--background-load`` into a
count; a bad value is a one-line ConfigError naming the flag) and calls the tool's ``run`` in
distrain/bench/ (one folder per tool), which checks what the values mean, measures, prints its
tables and writes its files.
"""

from __future__ import annotations

import argparse

from distrain.bench import background, common
from distrain.cli import bench_comm, bench_studies, bench_wan
from distrain.cli.bench_comm import add_background_argument
from distrain.bench.train.throughput import STRATEGIES as TRAIN_STRATEGIES
from distrain.bench.train.zero import STRATEGIES as ZERO_STRATEGIES
from distrain.errors import ConfigError
from distrain.parallel.pipeline_parallel import SCHEDULES

LAYOUTS = "ddp,zero3,tp2,pp2,dp2xtp2,tp2xpp2"


def add_parser(sub) -> None:
    """``distrain bench`` and its tools on the subparsers ``sub``."""
    bench = sub.add_parser("bench", help="benchmarks that compare ours with torch's, side by side")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for name, help_text, add, run in (
        *bench_comm.TOOLS,
        ("ps", "parameter-server round time (pull + push + update), beside the cost model", add_ps_arguments, run_ps),
        ("train", "training throughput: our DDP vs torch DDP vs parameter servers", add_train_arguments, run_train),
        ("pipeline", "pipeline bubble and activation peaks: GPipe, 1F1B, ZB-H1 against their formulas",
         add_pipeline_arguments, run_pipeline),
        ("tp", "tensor-parallel all-reduce bytes per block vs Megatron's count", add_tp_arguments, run_tp),
        ("zero", "memory per rank and step time: DDP, ZeRO-1/2/3 vs torch ZeRO-1 and FSDP2", add_zero_arguments,
         run_zero),
        ("layouts", "every layout (ddp, zero3, tp, pp, dp x tp x pp) on one model: samples/s and peak memory per "
                    "rank", add_layouts_arguments, run_layouts),
        ("elastic", "what --elastic costs per step (fixed vs elastic, alternated), its recovery and join times",
         add_elastic_arguments, run_elastic),
        *bench_studies.TOOLS,
        *bench_wan.TOOLS,
    ):
        p = bsub.add_parser(name, help=help_text)
        add(p)
        p.set_defaults(func=run)


def add_ps_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Synchronous parameter-server round (pull + push + update) time, measured and predicted."
    p.add_argument("--nproc", type=int, default=3, help="local ranks to spawn when not under a launcher (default 3)")
    p.add_argument("--servers", default="1,2", help="server counts S to run, comma-separated (default 1,2; S < P)")
    p.add_argument("--sizes", default="1M,4M,16M", help="model sizes in bytes, K/M = powers of 1024 (default 1M,4M,16M)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per size (default 1)")
    p.add_argument("--iters", type=int, default=3, help="timed rounds per size (default 3)")
    p.add_argument("--predict", nargs="?", const="auto", default=None, metavar="CALIBRATION",
                   help="add predicted_us from a `distrain bench link --json` file (no value: calibrate now)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the records as JSON")


def run_ps(args: argparse.Namespace) -> int:
    from distrain.bench.train import ps

    return ps.run(common.parse_sizes(args.sizes), common.parse_ints(args.servers, "--servers"), args.warmup,
                  args.iters, args.nproc, predict=args.predict, json_path=args.json)


# --------------------------------------------------------------------------- bench train, zero, layouts
def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", default="1,2,4", help="world sizes, comma-separated")
    p.add_argument("--strategy", "--strategies", dest="strategies", default=",".join(TRAIN_STRATEGIES),
                   help=f"comma-separated, any of {', '.join(TRAIN_STRATEGIES)}")
    p.add_argument("--model", default="mlp", help="mlp (Fashion-MNIST), gpt-small (Shakespeare), or a tiny preset")
    p.add_argument("--steps", type=int, default=30, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per job")
    p.add_argument("--batch-size", type=int, default=None, help="global batch (default: 240 for MLPs, 24 for GPTs: divisible by 1-4 workers)")
    p.add_argument("--algorithm", default="ring", help="all-reduce algorithm of our DDP")
    p.add_argument("--transport", default="torch",
                   help="transports of our strategies, comma-separated: torch, shm, auto (default torch)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size of ddp and torch-ddp")
    p.add_argument("--servers", type=int, default=1, help="parameter-server ranks for ps-*")
    p.add_argument("--max-staleness", type=int, default=2, help="staleness bound for ps-async")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole set, strategy order rotated")
    p.add_argument("--check-replicas", type=int, default=0, metavar="N",
                   help="ddp's jobs compare their replicas' bits every N steps (distrain train --check-replicas); "
                        "the table's last lines give the check's time and its share of the step time")
    p.add_argument("--json", default=None, help="write every record here")
    add_background_argument(p)


def run_train(args: argparse.Namespace) -> int:
    from distrain.bench.train import throughput

    nprocs = common.parse_ints(args.nproc, "--nproc")
    memory = [x for x in str(args.strategies).split(",") if x in ZERO_STRATEGIES and x not in TRAIN_STRATEGIES]
    if memory:  # torch's sharded strategies have no trainer engine: bench zero runs them beside ours
        raise ConfigError(f"--strategies {','.join(memory)}: torch's sharded strategies are measured by "
                          f"`distrain bench zero --strategies {args.strategies}` (step time, bytes held and peak "
                          f"memory per rank, side by side with ddp, zero1-3 and torch-ddp)")
    strategies = common.parse_choices(args.strategies, TRAIN_STRATEGIES, "--strategies")
    load = background.parse(getattr(args, "background_load", 0))
    transports = tuple(common.parse_choices(args.transport, ("torch", "shm", "auto"), "--transport"))
    return throughput.run(throughput.Settings(
        nprocs=nprocs, strategies=strategies, model=args.model, steps=args.steps, warmup=args.warmup,
        batch_size=args.batch_size, algorithm=args.algorithm, transports=transports, bucket_cap_mb=args.bucket_cap_mb,
        servers=args.servers, max_staleness=args.max_staleness, rounds=args.rounds, background_load=load,
        json_path=args.json, check_replicas=args.check_replicas))


def add_zero_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", default="2", help="world sizes, comma-separated")
    p.add_argument("--strategies", default="all", help=f"any of {', '.join(ZERO_STRATEGIES)} (or all)")
    p.add_argument("--model", default="gpt-small", help="a GPT preset (gpt-tiny, gpt-small)")
    p.add_argument("--n-embd", type=int, default=256, help="GPT width override")
    p.add_argument("--n-layer", type=int, default=8, help="GPT depth override")
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences of block_size tokens)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per job")
    p.add_argument("--algorithm", default="ring", help="collective algorithm of ours (native, star, ring, tree)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size of DDP, torch DDP, zero1/2")
    p.add_argument("--rounds", type=int, default=1, help="repeat every job, order rotated; medians over rounds")
    p.add_argument("--json", default=None, help="write every record here")


def run_zero(args: argparse.Namespace) -> int:
    from distrain.bench.train import zero

    return zero.run(zero.Settings(
        nprocs=common.parse_ints(args.nproc, "--nproc", minimum=2),
        strategies=common.parse_choices(args.strategies, ZERO_STRATEGIES, "--strategies"), model=args.model,
        n_embd=args.n_embd, n_layer=args.n_layer, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
        algorithm=args.algorithm, bucket_cap_mb=args.bucket_cap_mb, rounds=args.rounds, json_path=args.json))


def add_layouts_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-small", help="a text preset: gpt-tiny, gpt-small, llama-tiny, llama-small")
    p.add_argument("--nproc", default="2,4", help="world sizes, comma-separated (single at P=1 always runs)")
    p.add_argument("--layouts", default=LAYOUTS,
                   help="comma-separated: ddp, zero1-3, or dpAxcpDxtpBxppC grids (tp2, pp2, cp2, dp2xtp2, tp2xpp2, "
                        "dp2xcp2, zero1xpp2); epE adds expert parallelism to a mixture-of-experts model (ep2, "
                        "tp2xep2)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch of sequences (same for every job)")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step of layouts with pp > 1")
    p.add_argument("--schedule", default="1f1b", help="pipeline schedule of layouts with pp > 1 (gpipe, 1f1b, zb-h1)")
    p.add_argument("--algorithm", default="ring", help="collective algorithm of our DDP, ZeRO, TP and PP")
    p.add_argument("--cp-algorithm", default="ring", help="attention of layouts with cp > 1: ring or all-to-all")
    p.add_argument("--steps", type=int, default=10, help="timed steps per job")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per job, before the timed ones")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (the same for every job)")
    p.add_argument("--rounds", type=int, default=1, help="repeat every job, order rotated; medians over rounds")
    p.add_argument("--transport", default="torch",
                   help="how every job's ranks exchange bytes: torch (Gloo), shm (shared memory), auto (default torch)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per rank (0: spawn's default, cpu_count // P, as distrain train)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one job may take")
    p.add_argument("--layout-invariant", dest="invariant", default="off", choices=("off", "on", "both"),
                   help="train the jobs with --layout-invariant (on), or each job without and with it, alternated, "
                        "with the ratios (both)")
    p.add_argument("--units", type=int, default=0, help="--units of the --layout-invariant jobs (0: the default)")
    p.add_argument("--json", default=None, help="write every record here")


def run_layouts(args: argparse.Namespace) -> int:
    from distrain.bench.train import layouts

    return layouts.run(layouts.Settings(
        model=args.model, nprocs=common.parse_ints(args.nproc, "--nproc"), layouts=args.layouts,
        batch_size=args.batch_size, microbatches=args.microbatches, schedule=args.schedule, algorithm=args.algorithm,
        steps=args.steps, warmup=args.warmup, seed=args.seed, rounds=args.rounds, transport=args.transport,
        threads=args.threads, timeout=args.timeout, json_path=args.json, cp_algorithm=args.cp_algorithm,
        invariant=args.invariant, units=args.units))


# --------------------------------------------------------------------------- bench pipeline, bench tp
def add_pipeline_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pp", default="2,4", help="pipeline sizes")
    p.add_argument("--microbatches", "--m", dest="m", default="1,2,4,8", help="micro-batch counts, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="timed steps per configuration (median)")
    p.add_argument("--workload", default="spin", help="spin (busy CPU) or sleep (idle CPU) stage cost")
    p.add_argument("--schedules", default="gpipe,1f1b,zb-h1", help=f"schedules, comma-separated, among "
                                                                   f"{', '.join(SCHEDULES)}")
    p.add_argument("--virtual", type=int, default=0,
                   help="also run interleaved 1F1B with this many chunks per rank (0 or 1: not)")
    p.add_argument("--gantt", default=None, help="folder for a Gantt chart (PNG) of each configuration's last step")
    p.add_argument("--json", default=None)


def run_pipeline(args: argparse.Namespace) -> int:
    from distrain.bench.pipeline import bubbles

    workload = common.parse_choices(args.workload, ("spin", "sleep"), "--workload")[0]
    schedules = common.parse_choices(args.schedules, SCHEDULES, "--schedules")
    return bubbles.run(common.parse_ints(args.pp, "--pp", 2), common.parse_ints(args.m, "--m"), schedules,
                       repeats=args.repeats, workload=workload, virtual=args.virtual, gantt=args.gantt,
                       json_path=args.json)


def add_tp_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--algorithm", default="ring", help="star, ring or tree (native traffic is not visible)")


def run_tp(args: argparse.Namespace) -> int:
    from distrain.bench.tp import blocks

    return blocks.run(args.tp, args.model, args.batch_size, args.algorithm)


# --------------------------------------------------------------------------- bench elastic
def add_elastic_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Run the same `distrain train` job fixed and with --elastic, alternated, and compare the step "
                     "times; then kill a rank (and kill and replace one) and time the recovery and the join. "
                     "See docs/fault_tolerance.md.")
    p.add_argument("--nproc", type=int, default=4, help="ranks of every run (default 4)")
    p.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, zero3 or ps-sync (default ddp)")
    p.add_argument("--model", default="gpt-small", help="a preset or PKG.MOD:FACTORY, as for train (default gpt-small)")
    p.add_argument("--data", default="shakespeare", help="as for train (default shakespeare)")
    p.add_argument("--loss", default=None, help="as for train (your own model: e.g. cross-entropy)")
    p.add_argument("--steps", type=int, default=80, help="steps per run (default 80)")
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the step times (default 5)")
    p.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--dtype", default="float32", help="float32 or float64 (default float32)")
    p.add_argument("--rounds", type=int, default=6, help="fixed/elastic pairs, alternated (default 6)")
    p.add_argument("--kill-step", type=int, default=30, help="the step whose start kills rank id 1 (default 30)")
    p.add_argument("--no-faults", dest="faults", action="store_false",
                   help="the per-step cost only: no kill and no kill with a replacement (e.g. ZeRO at --nproc 2, "
                        "which cannot go on at one rank)")
    p.add_argument("--transport", default="torch", choices=("torch", "shm", "auto"),
                   help="--transport of every run (default torch)")
    p.add_argument("--json", default=None, help="write every record here")


def run_elastic(args: argparse.Namespace) -> int:
    from distrain.bench.elastic import cost

    extra = ("--loss", args.loss) if args.loss else ()
    cost.run(cost.Settings(nproc=args.nproc, strategy=args.strategy, model=args.model, data=args.data,
                           steps=args.steps, warmup=args.warmup, batch_size=args.batch_size, dtype=args.dtype,
                           rounds=args.rounds, kill_step=args.kill_step, transport=args.transport, extra=extra,
                           faults=args.faults, json_path=args.json))
    return 0


