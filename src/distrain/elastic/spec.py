"""``--elastic MIN:MAX``: parsing and the rules a job must meet, checked before any rank starts.

Contract: :func:`parse` turns ``"MIN:MAX"`` into two ints or raises ConfigError with the rule;
:func:`check` takes a TrainConfig-like object (duck-typed: ``elastic``, ``elastic_replace``,
``strategy``, ``nproc``, ...) and raises ConfigError naming the flag and the fix for the first
rule it breaks. Nothing here starts a process or touches torch.distributed.
"""

from __future__ import annotations

import re

from distrain.errors import ConfigError

# ddp: the whole state on every rank (a lost rank loses nothing the others lack); zero1/2/3: each rank
# holds one piece and a replica of its predecessor's (member.py), so one lost rank loses nothing either
# ps-sync: the workers hold no state (they pull the weights each step); a lost server ends the job
# diloco: a rank's own state is its island's inner progress since the last outer step, held by each of the
# island's ranks (DDP inside it): a lost rank whose island keeps one loses nothing, an island's last one drops
# that progress by design (the outer state, the same on every rank, survives on any rank)
SUPPORTED = ("ddp", "zero1", "zero2", "zero3", "ps-sync", "diloco")
_FORM = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse(text: str) -> tuple[int, int]:
    """``"2:4"`` -> (2, 4); ConfigError for anything else, or for MIN > MAX or MIN < 1."""
    m = _FORM.match(str(text))
    if m is None:
        raise ConfigError(f"--elastic {text!r} is malformed: give MIN:MAX, the fewest and the most ranks the job "
                          f"may run with, two whole numbers (e.g. --elastic 2:4)")
    lo, hi = int(m.group(1)), int(m.group(2))
    if lo < 1:
        raise ConfigError(f"--elastic {lo}:{hi}: MIN must be at least 1 rank, got {lo}")
    if lo > hi:
        raise ConfigError(f"--elastic {lo}:{hi}: MIN {lo} is larger than MAX {hi}; the job keeps between MIN and MAX "
                          f"ranks, so MIN <= MAX")
    return lo, hi


def check(cfg, launched: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The (MIN, MAX) of an elastic job, None for a fixed one; ConfigError on a broken rule.
    ``launched``: (rank, world size) when this process is one rank of a launched job
    (distrain.runtime.launched_rank, read at the process edge), None otherwise."""
    replace = getattr(cfg, "elastic_replace", 0)
    if not cfg.elastic:
        if replace:
            raise ConfigError(f"--elastic-replace {replace} starts replacement ranks of an elastic job: it needs "
                              f"--elastic MIN:MAX")
        return None
    lo, hi = parse(cfg.elastic)
    tag = f"--elastic {lo}:{hi}"
    if cfg.strategy not in SUPPORTED:
        raise ConfigError(f"{tag}: --strategy {cfg.strategy} is not supported; elastic training needs a state that "
                          f"survives a lost rank (every rank's state held twice, none on the ranks that may go, or, "
                          f"with diloco, only an island's progress since the last outer step): use --strategy "
                          f"{' or '.join(SUPPORTED)}")
    if cfg.strategy == "diloco":
        check_diloco(cfg, tag)
    tp, pp, cp = getattr(cfg, "tp", 1), getattr(cfg, "pp", 1), getattr(cfg, "cp", 1)
    if tp * pp * cp > 1:  # the dp dimension of dp x cp x tp x pp: a lost rank takes its whole replica with it
        check_grid(cfg, tag, lo, hi, tp * pp * cp)
    elif getattr(cfg, "dp", 0):
        raise ConfigError(f"{tag}: --dp is set by the number of live ranks in an elastic job; leave it out")
    if lo > cfg.nproc:
        raise ConfigError(f"{tag}: MIN {lo} is larger than --nproc {cfg.nproc}; the job would start below its "
                          f"minimum: use --nproc >= {lo} or a smaller MIN")
    if cfg.nproc > hi:
        raise ConfigError(f"{tag}: --nproc {cfg.nproc} is larger than MAX {hi}; use --nproc <= {hi} or a larger MAX")
    if not (isinstance(replace, int) and replace >= 0):
        raise ConfigError(f"--elastic-replace must be a whole number >= 0, got {replace!r}")
    if cfg.strategy == "ps-sync" and lo <= cfg.servers:
        raise ConfigError(f"{tag}: MIN {lo} leaves no worker beside the --servers {cfg.servers} parameter server(s); "
                          f"use MIN >= {cfg.servers + 1}")
    if cfg.batch_size < hi:
        raise ConfigError(f"{tag}: --batch-size {cfg.batch_size} is smaller than MAX {hi}; every rank needs at least "
                          f"one sample of the global batch")
    if getattr(cfg, "accum_steps", 1) != 1:
        raise ConfigError(f"{tag}: --accum-steps {cfg.accum_steps} is not supported (a rank's part of the batch may "
                          f"not divide into equal micro-batches after a change); use --accum-steps 1")
    if getattr(cfg, "device", "cpu") == "cuda":
        raise ConfigError(f"{tag}: --device cuda is not supported yet (NCCL); use --device cpu (Gloo)")
    if launched is not None:
        raise ConfigError(f"{tag}: runs under `distrain train` (its top process watches the ranks and hosts the "
                          f"store); under `distrain launch`/torchrun it is not supported yet")
    return lo, hi


def check_diloco(cfg, tag: str) -> None:
    """Elastic DiLoCo: plain DiLoCo (the outer step on one schedule, blocking), with one rank per island
    (--islands 0: K follows the live world, newcomers are new islands) or --islands K (each rank stays in
    the island it started in, an island goes on while one of its ranks lives, a newcomer founds an island
    while fewer than K live and otherwise joins the smallest; an outer mean that int8/int4 cannot cut per
    island). MIN and MAX count ranks, not islands: any MIN works (the job goes on down to one island), and
    --nproc must split into the K islands (checks/diloco.py)."""
    islands = getattr(cfg, "islands", 0)
    compression = getattr(cfg, "outer_compression", None)
    if islands and compression in ("int8", "int4"):
        raise ConfigError(f"{tag}: --outer-compression {compression} with --islands {islands} is not supported (the "
                          f"outer mean of islands of different sizes is a sum over every rank, which a quantized "
                          f"reduce-scatter of one chunk per island cannot make); use --outer-compression bf16 or "
                          f"leave it out")
    fragments, overlap = getattr(cfg, "fragments", 1), getattr(cfg, "overlap_steps", 0)
    if fragments != 1 or overlap:
        raise ConfigError(f"{tag}: Streaming DiLoCo (--fragments {fragments}, --overlap-steps {overlap}) is not "
                          f"supported (an exchange in flight across steps would carry a lost island's outer "
                          f"gradient); use --fragments 1 --overlap-steps 0")


def check_nodes(cfg, nodes) -> None:
    """An elastic job over several nodes (``nodes``: this node's elastic.nodes.NodeSpec, None on one host)
    keeps to --transport torch; ConfigError otherwise. On one host shm and auto are the shared-memory
    transport, a fresh one per membership epoch (member.py)."""
    transport = getattr(cfg, "transport", "torch")
    if nodes is not None and nodes.nodes > 1 and transport != "torch":
        raise ConfigError(f"--elastic over {nodes.nodes} nodes: --transport {transport} is not supported there (a "
                          f"group spread over several hosts re-forms only through torch's connections); use "
                          f"--transport torch, or run on one host")


def check_grid(cfg, tag: str, lo: int, hi: int, r: int) -> None:
    """Rules of an elastic dp x cp x tp x pp job (``r`` = cp x tp x pp ranks per model replica, which
    holds one copy of the model and reads one part of the batch): whole replicas only, DDP over dp,
    no newcomers, and a global batch that splits exactly at every size it may take."""
    cp = getattr(cfg, "cp", 1)
    sizes = (f"--cp {cp} x " if cp > 1 else "") + f"--tp {cfg.tp} x --pp {cfg.pp} = {r}"
    if cfg.strategy != "ddp":
        raise ConfigError(f"{tag}: with --tp/--pp only --strategy ddp is supported (the dp dimension; a ZeRO piece "
                          f"would be lost with its replica); got --strategy {cfg.strategy}")
    if getattr(cfg, "dp", 0):
        raise ConfigError(f"{tag}: --dp is set by the number of live replicas in an elastic job; leave it out")
    bad = [(n, v) for n, v in (("MIN", lo), ("MAX", hi), ("--nproc", cfg.nproc)) if v % r]
    if bad:
        raise ConfigError(f"{tag}: {bad[0][0]} {bad[0][1]} is not a multiple of {sizes} ranks per model replica; the "
                          f"job gains and loses whole replicas")
    if getattr(cfg, "elastic_replace", 0):
        raise ConfigError(f"{tag}: --elastic-replace is not supported with --tp/--pp (a newcomer would have to "
                          f"bring a whole replica of {r} ranks at once); leave it out")
    m = cfg.microbatches
    for dp in range(lo // r, cfg.nproc // r + 1) if cfg.pp > 1 else ():  # (pp: equal micro-batches per part)
        if cfg.batch_size % (dp * m):
            raise ConfigError(f"{tag}: --batch-size {cfg.batch_size} does not split into {dp} replica(s) x {m} "
                              f"micro-batch(es), a size the job may shrink to; use a batch size divisible by "
                              f"{m} x each of {list(range(lo // r, cfg.nproc // r + 1))}")
