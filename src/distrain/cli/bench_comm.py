"""``distrain bench comm`` and ``bench link``: the communication layer's benchmarks (docs/benchmarks.md,
docs/cost_model.md), and ``--background-load`` that ``bench comm`` and ``bench train`` share.

    distrain bench comm --nproc 4 --ops all_reduce --algorithms native,ring --sizes 4K,4M
    distrain bench link --sizes 8,256K,1M,4M --iters 3 --json link.json

Like every tool of :mod:`distrain.cli.bench`, ``add_TOOL_arguments(parser)`` declares the flags and
``run_TOOL(args)`` turns them into typed values (a bad value is a one-line ConfigError naming the flag) and calls
the tool's ``run`` in distrain/bench/; ``bench comm``'s flags become the plain ``cfg`` dict its ranks receive
(:func:`comm_config`). :data:`TOOLS` is what ``distrain bench`` registers.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from distrain.bench import background, common
from distrain.bench.comm import columns
from distrain.bench.comm.timing import DTYPES, BURST_S, MAX_BURST, MAX_ITERS, MIN_ITERS, TARGET_S
from distrain.comm.api import ALGORITHM_NAMES, COLLECTIVES
from distrain.comm.core.transport import TRANSPORT_NAMES
from distrain.errors import ConfigError

COMM_NPROC = "2,4"
COMM_OPS = "all_reduce"
COMM_ALGORITHMS = ",".join(ALGORITHM_NAMES)
COMM_SIZES = "4K,256K,4M,16M"
COMM_TRANSPORTS = "torch"
LINK_SIZES = "8,64K,256K,1M,4M,16M"


def add_background_argument(p: argparse.ArgumentParser) -> None:
    """``--background-load N`` (distrain/bench/background.py) of ``bench comm`` and ``bench train``."""
    p.add_argument(background.FLAG, dest="background_load", default="0", metavar="N",
                   help="start N busy processes (a tight CPU loop each, unpinned) before measuring and stop them "
                        "after, to measure on a loaded machine; the load average at the start and end of every "
                        "measurement goes into the JSON and the table (default 0)")


def add_comm_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Time the collectives of distrain.comm for every algorithm side by side and print "
                     "nccl-tests-style tables (time, algbw, busbw). See docs/benchmarks.md.")
    p.add_argument("--nproc", default=COMM_NPROC,
                   help=f"world size(s), e.g. 4 or 2,4: one spawn each (default {COMM_NPROC})")
    p.add_argument("--ops", default=COMM_OPS,
                   help=f"collectives, comma-separated or 'all', from {', '.join(COLLECTIVES)} "
                        f"(default {COMM_OPS}; barrier reports time only)")
    p.add_argument("--algorithms", default=COMM_ALGORITHMS,
                   help=f"algorithms, comma-separated or 'all' (default {COMM_ALGORITHMS})")
    p.add_argument("--transport", default=COMM_TRANSPORTS,
                   help=f"transports to compare, comma-separated: {', '.join(TRANSPORT_NAMES)} (default torch); also "
                        f"shm-python (shm with its Python kernels, beside the compiled ones) and deepspeed "
                        f"(DeepSpeed's C++ shared-memory all_reduce when deepspeed is importable: sum of "
                        f"float32/bfloat16/float16, one column)")
    p.add_argument("--symmetric", action="store_true",
                   help="also time native on buffers in symmetric memory (comm.symmetric_empty: every peer maps "
                        "them, so all_reduce works in place, no copy through the slots): a native@shm+sym column for "
                        "each shared-memory transport")
    p.add_argument("--sizes", default=COMM_SIZES,
                   help=f"full-buffer sizes in bytes, K/M/G = powers of 1024 (default {COMM_SIZES})")
    p.add_argument("--dtype", default="float32", help=f"element type, one of {', '.join(DTYPES)} (default float32)")
    p.add_argument("--warmup", default="3", help="untimed rounds per (op, size) before timing (default 3)")
    p.add_argument("--iters", default=None,
                   help=f"timed rounds per (op, size); default adaptive: ceil({TARGET_S} s / slowest warm-up call) "
                        f"clamped to [{MIN_ITERS}, {MAX_ITERS}]")
    p.add_argument("--burst", default=None,
                   help=f"calls back to back per timed sample (time / calls); default adaptive: about "
                        f"{BURST_S * 1e3:g} ms, at most {MAX_BURST}; 1 = one call after each barrier")
    p.add_argument("--start", default="window", choices=["window", "barrier"],
                   help="each sample's start: window = a common instant on ping-pong-corrected clocks, timed from it "
                        "(what the cost model assumes); barrier = each rank's exit from a native barrier (default window)")
    p.add_argument("--bind-cores", default="auto", choices=["auto", "on", "off"],
                   help="pin each rank to cores of its own (distrain.spawn's bind_cores); auto: when a measured "
                        "transport polls shared memory (shm, auto) and P cores are free at the start (not under "
                        "load: a bound rank cannot leave a busy core). Gloo is faster unbound with one core per rank")
    p.add_argument("--json", default=None, metavar="PATH", help="write every median and metadata as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a busbw-vs-size figure (PNG, matplotlib)")
    p.add_argument("--markdown", default=None, metavar="PATH", help="write the tables as Markdown (for docs)")
    p.add_argument("--predict", nargs="?", const="auto", default=None, metavar="CALIBRATION",
                   help="add the cost model's predicted_us to every record, with links from a `distrain bench link "
                        "--json` file, or (no value) from a short ping-pong at the start (docs/cost_model.md)")
    p.add_argument("--timeout", default="3600", help="seconds allowed for each world size's spawn (default 3600)")
    add_background_argument(p)


def comm_config(args: argparse.Namespace) -> dict[str, Any]:
    """Validate every flag of ``bench comm`` (ConfigError with a clear message) into a plain, picklable dict."""
    dtype = str(args.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype: unknown or unsupported dtype {args.dtype!r}; use one of {', '.join(DTYPES)}")
    try:
        timeout = float(args.timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"--timeout: expected seconds, got {args.timeout!r}") from None
    if not timeout > 0:
        raise ConfigError(f"--timeout: must be positive, got {args.timeout!r}")
    cfg = {
        "nprocs": common.parse_ints(args.nproc, "--nproc", minimum=1),
        "ops": common.parse_choices(args.ops, COLLECTIVES, "--ops"),
        "algorithms": common.parse_choices(args.algorithms, ALGORITHM_NAMES, "--algorithms"),
        "transports": common.parse_choices(getattr(args, "transport", COMM_TRANSPORTS),
                                           (*TRANSPORT_NAMES, *columns.EXTRA), "--transport"),
        "sizes": common.parse_sizes(args.sizes),
        "symmetric": bool(getattr(args, "symmetric", False)),
        "dtype": dtype,
        "warmup": common.parse_int(args.warmup, "--warmup", 0),
        "iters": None if args.iters in (None, "", "auto") else common.parse_int(args.iters, "--iters", 1),
        "burst": None if getattr(args, "burst", None) in (None, "", "auto") else common.parse_int(args.burst, "--burst", 1),
        "timeout": timeout,
        "start": getattr(args, "start", "window"),
        "bind_cores": None,
        "target_s": TARGET_S,
        "predict": getattr(args, "predict", None),
        "background_load": background.parse(getattr(args, "background_load", 0)),
    }
    columns.check(cfg["transports"], cfg["ops"], dtype)
    if cfg["symmetric"] and not ("native" in cfg["algorithms"] and {"shm", "auto"} & set(cfg["transports"])):
        raise ConfigError("--symmetric: times native on symmetric buffers of a shared-memory transport; add shm (or "
                          "auto) to --transport and native to --algorithms")
    bind = getattr(args, "bind_cores", "auto")
    # auto: ranks polling shared memory are bound when P cores are free at the start (launch/cores.py)
    cfg["bind_cores"] = (bind == "on") if bind != "auto" else \
        (None if any(t in ("shm", "auto", *columns.EXTRA) for t in cfg["transports"]) else False)
    if cfg["predict"] not in (None, "auto") and not os.path.isfile(cfg["predict"]):
        raise ConfigError(f"--predict: no calibration file {cfg['predict']!r}; write one with "
                          f"`distrain bench link --json {cfg['predict']}` or give --predict alone to calibrate now")
    if args.plot:
        common.require_pyplot()  # fail before the (long) measurement, not after
    return cfg


def comm_command_line(args: argparse.Namespace) -> str:
    """The equivalent ``distrain bench comm ...`` command, every flag spelled out."""
    parts = ["distrain", "bench", "comm"]
    for flag in ("nproc", "ops", "algorithms", "transport", "sizes", "dtype", "warmup", "iters", "json", "plot",
                 "timeout", "predict", "background_load", "symmetric", "start"):
        v = getattr(args, flag, None)
        if v is True:
            parts.append(f"--{flag}")
        elif v not in (None, False):
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    return " ".join(parts)


def run_comm(args: argparse.Namespace) -> int:
    from distrain.bench.comm import collectives

    return collectives.run(comm_config(args), json_path=args.json, plot_path=args.plot, markdown_path=args.markdown,
                           command=comm_command_line(args))


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    p.description = "Ping-pong α-β calibration of every link (rank 0 with each other rank); see docs/cost_model.md."
    p.add_argument("--nproc", type=int, default=2, help="local ranks to spawn when not under a launcher (default 2)")
    p.add_argument("--sizes", default=LINK_SIZES, help=f"message sizes, K/M = powers of 1024 (default {LINK_SIZES})")
    p.add_argument("--fan-sizes", default=None, metavar="SIZES",
                   help="bytes per flow of the fan (k ranks into rank 0 at once, and out of it: TCP incast), "
                        "comma-separated; the sizes the collectives send (default: the largest of --sizes)")
    p.add_argument("--warmup", type=int, default=2, help="untimed round trips per size (default 2)")
    p.add_argument("--iters", type=int, default=7, help="timed round trips per size (default 7)")
    p.add_argument("--json", default=None, metavar="PATH", help="write records and the fitted model as JSON")
    p.add_argument("--transport", default="torch",
                   help=f"transports to ping-pong over, comma-separated: {', '.join(TRANSPORT_NAMES)}, "
                        f"{columns.PYTHON_SHM} (default torch); the first is the fitted link, the others' one-way "
                        f"times are printed beside it")


def run_link(args: argparse.Namespace) -> int:
    from distrain.bench.link import calibrate

    transports = common.parse_choices(args.transport, (*TRANSPORT_NAMES, columns.PYTHON_SHM), "--transport")
    return calibrate.run(common.parse_sizes(args.sizes), args.warmup, args.iters, args.nproc, json_path=args.json,
                         transports=tuple(transports),
                         fan_sizes=tuple(common.parse_sizes(args.fan_sizes)) if args.fan_sizes else ())


TOOLS = (
    ("comm", "collective bandwidth: native vs star/ring/tree (nccl-tests style)", add_comm_arguments, run_comm),
    ("link", "ping-pong calibration of alpha and beta per link (for the cost model)", add_link_arguments, run_link),
)
