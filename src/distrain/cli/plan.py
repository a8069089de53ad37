"""``distrain plan``: predicted step time of training layouts, on emulated nodes or a GPU cluster.

    distrain plan --model gpt-small --nodes 4 --procs-per-node 2 --link eth-1g
    distrain plan --model llama-3-8b --device h100 --nodes 4 --gpus-per-node 8 --link ib-400g --seq-len 4096
    distrain plan --validate docs/cost_model_data/published_runs.toml
    distrain plan --fit-efficiency docs/cost_model_data/mosaicml_benchmarks.csv
    distrain plan --measure-host docs/cost_model_data/cpu_host.json

Without ``--device`` it ranks DDP / parameter servers / dp x tp x pp on ranks whose compute is
measured here or given (``--compute-ms``) and whose links are α-β presets or a ``bench link``
calibration (:mod:`distrain.costmodel.plan`). With ``--device`` it plans a cluster of devices:
compute from the model's shape and the device (:mod:`distrain.costmodel.kernels`), memory per
device, NCCL rings, every dp x tp x pp x cp layout ranked (:mod:`distrain.costmodel.layouts`);
layout flags fix a field. ``--validate FILE`` predicts published runs
(:mod:`distrain.costmodel.validation`). See docs/cost_model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex

from distrain.costmodel.links import INTRA, LINKS, Fabric, block_placement, calibrated_fabric
from distrain.errors import ConfigError

LAYOUT_FLAGS = ("dp", "tp", "pp", "cp", "ep", "zero", "micro_batch", "recompute", "vpp")


def add_parser(sub) -> None:
    """``distrain plan`` on the subparsers ``sub``."""
    p = sub.add_parser("plan", help="predict and rank training layouts (DDP/PS/dp x tp x pp on emulated nodes; "
                                    "dp x tp x pp x cp, ZeRO, recomputation on a GPU cluster with --device)")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = ("Predicted step time, memory and busiest-link bytes of training layouts; with --device, of a GPU "
                     "cluster from the model's shape; see docs/cost_model.md.")
    p.add_argument("--model", default="gpt-small", help="a model preset or published shape (default gpt-small)")
    p.add_argument("--params", type=int, default=None, help="plan for N parameters instead (DDP/PS only)")
    p.add_argument("--nodes", type=int, default=4, help="nodes (default 4)")
    p.add_argument("--procs-per-node", type=int, default=None, help="ranks per node (default 1)")
    p.add_argument("--link", default=None, help=f"between nodes: {', '.join(LINKS)} (default eth-1g; with --device "
                                                f"ib-400g, one port per device)")
    p.add_argument("--intra", default=None, help=f"within a node: {', '.join(INTRA)} (default shm; with --device the "
                                                 f"device's NVLink)")
    p.add_argument("--calibration", default=None, help="use a `distrain bench link --json` file for the links instead")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch in samples (default 32; with --device one sequence per device)")
    p.add_argument("--microbatches", type=int, default=8, help="pipeline micro-batches (default 8; not with --device)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sample (default: the preset's block size; the shape-only Llama presets' is "
                        "their 8192-token context, whose s^2 attention term dominates the activation estimate)")
    p.add_argument("--compute-ms", type=float, default=None,
                   help="forward+backward of the global batch on one process; default: measured here (presets)")
    p.add_argument("--inner-steps", type=int, nargs="+", default=None, metavar="H",
                   help="also predict DiLoCo (one island per node) with H inner steps against DDP, and the link "
                        "bandwidth below which it pays (docs/slow_links.md); not with --device")
    p.add_argument("--fragments", type=int, default=None, metavar="P",
                   help="with --inner-steps: also predict Streaming DiLoCo with the parameters in P fragments, as "
                        "train's --fragments cuts them (docs/slow_links.md)")
    p.add_argument("--overlap-steps", type=int, default=None, metavar="TAU",
                   help="with --fragments: each fragment's exchange overlapped with TAU inner steps, as train's "
                        "--overlap-steps (0..H-1, default 0; int8/int4 rows stay at 0, as training requires)")
    p.add_argument("--memory-gb", type=float, default=None,
                   help="memory of one rank in GB that a layout must fit (default: this host's available memory "
                        "over --procs-per-node; with --device the device's)")
    g = p.add_argument_group("a cluster of devices (--device)")
    g.add_argument("--device", default=None, help="h100, h200, a100-40g, a100-80g, h100-hbm2e, cpu: plan a cluster of "
                                                  "these from the model's shape (docs/cost_model.md, Devices)")
    g.add_argument("--gpus-per-node", type=int, default=None, help="devices per node (default 8; 1 for --device cpu)")
    g.add_argument("--efficiency", choices=("sustained", "nominal"), default="sustained",
                   help="kernel efficiencies: sustained (fitted on published runs, default) or nominal (kernel "
                        "benchmarks)")
    g.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    g.add_argument("--validate", default=None, metavar="FILE",
                   help="predict every published run in FILE (TOML) and print published, predicted and error")
    g.add_argument("--markdown", action="store_true", help="with --validate: the table as Markdown")
    g.add_argument("--fit-efficiency", default=None, metavar="CSV",
                   help="fit the sustained-efficiency multipliers on MosaicML's llm-foundry table (the runs "
                        "--validate does not hold out) and print them (docs/cost_model.md)")
    g.add_argument("--measure-host", nargs="?", const="", default=None, metavar="JSON",
                   help="measure this host as a device (matmul, attention, memory copy) and print it (write JSON)")
    s = p.add_argument_group("a model shape instead of --model")
    s.add_argument("--arch", choices=("llama", "gpt"), default="llama",
                   help="llama: SwiGLU, RMSNorm, rotary, no biases; gpt: GELU 4h MLP, LayerNorm, biases, learned "
                        "positions")
    for flag, what in (("layers", "transformer blocks"), ("hidden", "hidden size"), ("heads", "query heads"),
                       ("kv-heads", "key/value heads (default: --heads)"), ("ffn", "MLP width (per expert)"),
                       ("vocab", "vocabulary"), ("experts", "experts per MoE layer"), ("top-k", "experts per token")):
        s.add_argument(f"--{flag}", type=int, default=None, help=what)
    s.add_argument("--tied", action="store_true", help="the output head shares the embedding")
    lay = p.add_argument_group("fix a layout field (the others are searched)")
    for flag in ("dp", "tp", "pp", "cp", "ep", "zero", "micro-batch", "vpp"):
        lay.add_argument(f"--{flag}", type=int, default=None,
                         help={"zero": "ZeRO stage 0-3 (3: FSDP)", "vpp": "interleaved pipeline chunks per stage",
                               "micro-batch": "sequences per micro-batch"}.get(flag, f"{flag} size"))
    lay.add_argument("--recompute", default=None, help="none, selective, op (torchtitan's op-level), full")
    lay.add_argument("--no-sp", action="store_true", help="tensor parallelism without sequence parallelism")
    lay.add_argument("--tp-overlap", action="store_true", help="tensor-parallel collectives overlap the matmuls")
    lay.add_argument("--no-dp-overlap", action="store_true", help="data-parallel collectives do not overlap backward")
    lay.add_argument("--attention", choices=("fa2", "fa3"), default="fa2",
                     help="fused attention kernel: fa2 (PyTorch SDPA, default) or fa3 (FlashAttention-3/cuDNN, Hopper)")


def run(args: argparse.Namespace) -> int:
    if args.fit_efficiency:
        from distrain.costmodel import calibration

        return calibration.report(args.fit_efficiency)
    if args.measure_host is not None:
        from distrain.costmodel import devices

        return devices.report_host(args.measure_host or None)
    if args.validate:
        return _validate(args.validate, args.markdown)
    if args.device or args.gpus_per_node:
        if args.inner_steps or args.fragments is not None or args.overlap_steps is not None:
            raise ConfigError("--inner-steps plans DiLoCo on emulated nodes; drop --device/--gpus-per-node")
        return _run_cluster(args)
    return _run_emulated(args)


# -- emulated nodes (the α-β simulator) ---------------------------------------------------------
def _run_emulated(args: argparse.Namespace) -> int:
    from distrain.costmodel.plan import Compute, format_plans, measured_compute, model_spec, plans

    args.procs_per_node = args.procs_per_node or 1
    args.batch_size = args.batch_size or 32
    link, intra = args.link or "eth-1g", args.intra or "shm"
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
        if link not in LINKS or intra not in INTRA:
            raise ConfigError(f"--link must be one of {', '.join(LINKS)} and --intra one of {', '.join(INTRA)}")
        fabric = Fabric(placement, LINKS[link], INTRA[intra])
    if args.compute_ms is not None:
        c = Compute.linear(args.compute_ms / 1e3, args.batch_size)
    elif args.params:
        raise ConfigError("--params needs --compute-ms (forward+backward time of the global batch on one process)")
    else:
        c = measured_compute(args.model)
    if not args.inner_steps and (args.fragments is not None or args.overlap_steps is not None):
        raise ConfigError("--fragments/--overlap-steps plan Streaming DiLoCo: give --inner-steps H as well")
    if args.overlap_steps is not None and args.fragments is None:
        raise ConfigError(f"--overlap-steps {args.overlap_steps}: give --fragments P as well (1: DiLoCo's one "
                          f"exchange, overlapped)")
    diloco = _diloco(args, m, fabric, c) if args.inner_steps else None  # its bad input refused before any output
    limit, source = _rank_memory(args)
    rows = plans(m, fabric, c, args.batch_size, args.procs_per_node, args.microbatches)
    how = "given" if args.compute_ms is not None else f"measured here, AdamW {c.opt * m.params * 1e3:.1f} ms"
    print(f"# {m.name}: {m.params:,} parameters, batch {args.batch_size}, forward+backward "
          f"{c.fb(args.batch_size) * 1e3:.1f} ms on one process ({how}); {args.nodes} node(s) x "
          f"{args.procs_per_node} = {P} ranks; link {args.calibration or link} (intra {intra}); memory: {source}")
    print(format_plans(rows, limit))
    if all(r.mem_bytes > limit for r in rows):
        small = min(rows, key=lambda r: r.mem_bytes)
        print(f"# no layout fits: the smallest, {small.strategy}, needs {small.mem_bytes / 1e9:.1f} GB per rank; "
              f"add nodes (--nodes: more pipeline stages), give ranks more memory (--memory-gb) or plan a smaller "
              f"model")
    if diloco:
        print(diloco)
    return 0


def _rank_memory(args: argparse.Namespace) -> tuple[float, str]:
    """(bytes one rank may hold, where the figure comes from): --memory-gb, else this host's available
    memory shared by the --procs-per-node ranks of a node (each emulated node a host like this one)."""
    if args.memory_gb is not None:
        return _memory_gb(args.memory_gb), f"{args.memory_gb:g} GB per rank (--memory-gb)"
    from distrain.runtime import available_memory

    here = available_memory()
    if here is None:
        raise ConfigError("plan: this host's available memory is unknown (no MemAvailable in /proc/meminfo); give "
                          "the memory of one rank with --memory-gb")
    return here / args.procs_per_node, (f"{here / 1e9:.1f} GB available here / {args.procs_per_node} ranks per node "
                                        f"(--memory-gb sets a rank's)")


def _memory_gb(gb: float) -> float:
    if not gb > 0:
        raise ConfigError(f"--memory-gb must be a positive number of GB, got {gb}")
    return gb * 1e9


def _diloco(args: argparse.Namespace, m, fabric: Fabric, c) -> str:
    """--inner-steps (--fragments, --overlap-steps): DiLoCo's rows against DDP and where it pays
    (:func:`distrain.costmodel.diloco.report`)."""
    from distrain.costmodel import diloco

    if min(args.inner_steps) < 1:
        raise ConfigError(f"--inner-steps {min(args.inner_steps)}: give H >= 1 inner steps between outer steps")
    outer = diloco.measure_outer(args.model) if args.compute_ms is None else 0.0
    return diloco.report(m, fabric, c, args.batch_size, args.inner_steps, outer, args.fragments,
                         args.overlap_steps or 0)


# -- a cluster of devices ----------------------------------------------------------------------
def _shape(args: argparse.Namespace):
    from distrain.costmodel.shapes import Shape, preset_shape, with_positions

    if args.layers is None:
        if any(getattr(args, k) is not None for k in ("hidden", "heads", "kv_heads", "ffn", "vocab", "experts")):
            raise ConfigError("a model shape needs --layers with --hidden, --heads and --vocab (or give --model only)")
        shape = preset_shape(args.model)
    else:
        need = [f"--{k}" for k in ("hidden", "heads", "vocab") if getattr(args, k) is None]
        if need:
            raise ConfigError(f"--layers: a model shape also needs {', '.join(need)}")
        gpt = args.arch == "gpt"
        if args.ffn is None:
            from distrain.models.llama.model import swiglu_hidden

            args.ffn = 4 * args.hidden if gpt else swiglu_hidden(args.hidden)
        shape = Shape(f"{args.arch} {args.layers}x{args.hidden}", args.layers, args.hidden, args.heads,
                      args.kv_heads or args.heads, args.ffn, args.vocab, gated=not gpt, bias=gpt, tied=args.tied,
                      positions=1 if gpt else 0, experts=args.experts or 0, top_k=args.top_k or 0)
    seq = args.seq_len
    if seq is None:
        from distrain.models.registry import MODEL_PRESETS

        if args.layers is not None or args.model not in MODEL_PRESETS:
            raise ConfigError(f"--seq-len: {shape.name} has no preset sequence length; give --seq-len")
        seq = MODEL_PRESETS[args.model][1]["block_size"]
    if seq < 1:
        raise ConfigError(f"--seq-len must be >= 1, got {seq}")
    return with_positions(shape, seq), seq


def _case(args: argparse.Namespace):
    """(the Case with a placeholder layout, the fixed layout fields) from the flags."""
    from distrain.costmodel.devices import device
    from distrain.costmodel.links import fabric_from_model
    from distrain.costmodel.step import Case, Cluster, Layout

    dev = device(args.device or "h100")
    if args.procs_per_node and args.gpus_per_node and args.procs_per_node != args.gpus_per_node:
        raise ConfigError(f"--procs-per-node {args.procs_per_node} and --gpus-per-node {args.gpus_per_node} disagree; "
                          f"give one")
    per_node = args.gpus_per_node or args.procs_per_node or (1 if dev.family == "cpu" else 8)
    if args.calibration:
        import json

        try:
            with open(args.calibration) as f:
                model = json.load(f)["model"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ConfigError(f"--calibration {args.calibration}: cannot read a `bench link` model ({e})") from None
        fab = fabric_from_model(model, [0, 1])
        inter, intra = fab.inter, fab.intra
    else:
        link, intra_name = args.link or ("eth-1g" if dev.family == "cpu" else "ib-400g"), args.intra or dev.intra
        if link not in LINKS or intra_name not in INTRA:
            raise ConfigError(f"--link must be one of {', '.join(LINKS)} and --intra one of {', '.join(INTRA)}")
        inter, intra = LINKS[link], INTRA[intra_name]
    if args.memory_gb is not None:  # a device with this much memory
        dev = dataclasses.replace(dev, memory=_memory_gb(args.memory_gb))
    cluster = Cluster(dev, args.nodes, per_node, inter, intra)
    shape, seq = _shape(args)
    batch = args.batch_size or cluster.size
    if batch < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch}")
    fixed = {k: getattr(args, k) for k in LAYOUT_FLAGS if getattr(args, k) is not None}
    fixed.update(sp=not args.no_sp, tp_overlap=args.tp_overlap, dp_overlap=not args.no_dp_overlap,
                 attention=args.attention)
    given = {k: v for k, v in fixed.items() if k in ("dp", "tp", "pp", "cp")}
    if len(given) == 4 and given["dp"] * given["tp"] * given["pp"] * given["cp"] != cluster.size:
        raise ConfigError(f"--dp {given['dp']} x --tp {given['tp']} x --pp {given['pp']} x --cp {given['cp']} = "
                          f"{given['dp'] * given['tp'] * given['pp'] * given['cp']} devices, but --nodes {args.nodes} x "
                          f"--gpus-per-node {per_node} = {cluster.size}; make them equal")
    return Case(shape, cluster, Layout(), batch, seq), fixed


def _one_layout(case, fixed: dict):
    """The single layout the fixed fields leave, checked (a one-line error names what is wrong)."""
    from distrain.costmodel.layouts import candidates
    from distrain.costmodel.step import Layout, check

    rest = {k: v for k, v in fixed.items() if k in Layout.__dataclass_fields__}
    model = fixed.get("tp", 1) * fixed.get("pp", 1) * fixed.get("cp", 1)
    if model < 1 or case.cluster.size % model:
        raise ConfigError(f"--tp {fixed.get('tp', 1)} x --pp {fixed.get('pp', 1)} x --cp {fixed.get('cp', 1)} = {model} "
                          f"does not divide the cluster's {case.cluster.size} devices; choose sizes whose product does")
    layout = Layout(**{"dp": case.cluster.size // model, **rest})
    check(case.shape, case.cluster, layout, case.batch, case.seq)
    options = candidates(case, fixed)
    return layout if options else None


def _run_cluster(args: argparse.Namespace) -> int:
    from distrain.costmodel.layouts import explain, format_predictions, rank

    case, fixed = _case(args)
    cl, shape = case.cluster, case.shape
    if all(k in fixed for k in ("tp", "pp", "cp", "zero", "micro_batch", "recompute")):
        _one_layout(case, fixed)
    fits, too_big = rank(case, fixed, args.efficiency)
    if not fits:
        if too_big:
            p = too_big[0]
            raise ConfigError(f"no layout fits: the smallest, {p.layout.name()}, needs {p.memory.total / 1e9:.1f} GB "
                              f"per device and the {cl.device.name} has {cl.device.memory / 1e9:.0f} GB; "
                              f"{no_fit_hint(fixed)}")
        _one_layout(case, fixed)  # the fixed fields' own error, if they make one
        raise ConfigError("no layout satisfies the fixed flags on this cluster; fix fewer of them")
    link = args.calibration or args.link or ("eth-1g" if cl.device.family == "cpu" else "ib-400g")
    given = ", --memory-gb" if args.memory_gb is not None else ""
    print(f"# {shape.describe()}; {cl.nodes} node(s) x {cl.per_node} {cl.device.name} = {cl.size} devices "
          f"({cl.device.memory / 1e9:.3g} GB each{given}); link {link} per device, intra "
          f"{args.intra or cl.device.intra}; "
          f"batch {case.batch} x {case.seq} tokens; {args.efficiency} efficiencies")
    print(format_predictions(fits, args.top))
    print(f"# {len(fits)} layouts fit, {len(too_big)} do not fit the device's memory")
    print(explain(fits, cl.device.memory))
    return 0


def no_fit_hint(fixed: dict) -> str:
    """What could make a layout fit, given the fields the flags ``fixed``: only what the search did not
    already try (an open field was searched over all its values), never what the layout already uses."""
    ways = []
    pinned = [f"--{k}" for k in ("tp", "pp", "cp") if k in fixed]
    if pinned:
        ways.append(f"leave {'/'.join(pinned)} open (or larger)")
    if fixed.get("zero", 3) < 3 and fixed.get("pp", 1) == 1:  # (ZeRO-3 only without a pipeline)
        ways.append("--zero 3")
    if fixed.get("recompute", "full") != "full":
        ways.append("--recompute full")
    if fixed.get("micro_batch", 1) > 1:
        ways.append("--micro-batch 1")
    ways.append("add devices (--nodes)" if fixed.get("zero", 3) or any(k not in fixed for k in ("tp", "pp"))
                else "a device with more memory")
    return ", ".join(ways[:-1]) + f" or {ways[-1]}" if len(ways) > 1 else ways[0]


def _validate(path: str, markdown: bool) -> int:
    from distrain.costmodel.step import metric
    from distrain.costmodel.validation import format_summary, load, summary, table

    rows = load(path)
    for i, row in enumerate(rows, 1):
        parser = argparse.ArgumentParser(prog="distrain plan", exit_on_error=False)
        add_arguments(parser)
        try:
            args = parser.parse_args(shlex.split(row.command)[2:])
        except (argparse.ArgumentError, SystemExit) as e:
            raise ConfigError(f"--validate {path}: run {i}'s command does not parse ({e})") from None
        if not args.device:
            raise ConfigError(f"--validate {path}: run {i}'s command needs --device")
        case, fixed = _case(args)
        layout = _one_layout(case, fixed)
        if layout is None or not all(k in fixed for k in ("tp", "pp", "cp", "zero", "micro_batch", "recompute")):
            raise ConfigError(f"--validate {path}: run {i}'s command leaves its layout open; give --tp, --pp, --cp, "
                              f"--zero, --micro-batch and --recompute")
        case = dataclasses.replace(case, layout=layout)
        row.predicted = metric(case, case.predict("sustained"), row.metric)
        row.nominal = metric(case, case.predict("nominal"), row.metric)
    print(table(rows, markdown))
    print(format_summary(summary(rows)))
    return 0
