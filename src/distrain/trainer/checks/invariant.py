"""--layout-invariant: what it covers today, and the unit of work every layout must share
(docs/determinism.md)."""

from __future__ import annotations

from distrain.parallel.invariant.units import default_units
from distrain.trainer.checks.need import need

# the strategies whose every reduction distrain orders (torch's DDP reducer, an asynchronous server and a
# run without gradient exchange cannot give one process's bits)
INVARIANT_STRATEGIES = ("single", "ddp", "zero1", "zero2", "zero3", "ps-sync", "diloco")
# the tp sizes --layout-invariant covers: those dividing the canonical chunks
# (distrain.parallel.tensor_parallel.invariant.INVARIANT_CHUNKS = 4)
INVARIANT_TP = (1, 2, 4)


def units_of(cfg) -> int:
    """U: --units, or its default for the batch."""
    return cfg.units or default_units(cfg.batch_size)


def check_invariant(cfg) -> None:
    need(cfg.units >= 0, f"--units must be >= 0 (0: the default), got {cfg.units}")
    if not cfg.layout_invariant:
        need(cfg.units == 0, f"--units {cfg.units} only acts with --layout-invariant: add it, or drop --units")
        need(not cfg.invariant_tp, "--invariant-tp only acts with --layout-invariant: add it, or drop --invariant-tp")
        return
    u = units_of(cfg)
    need(cfg.strategy in INVARIANT_STRATEGIES,
         f"--layout-invariant: --strategy {cfg.strategy} is not covered (torch-ddp's reducer and ps-async's "
         f"updates order sums outside distrain); use --strategy {', '.join(INVARIANT_STRATEGIES)}")
    need(cfg.batch_size % u == 0,
         f"--layout-invariant: --units {u} must divide --batch-size {cfg.batch_size}; "
         f"use one of {', '.join(str(d) for d in range(1, cfg.batch_size + 1) if cfg.batch_size % d == 0)}")
    grid = {"--cp": cfg.cp, "--ep": cfg.ep}
    bad = [f"{k} {v}" for k, v in grid.items() if v > 1]
    need(not bad, f"--layout-invariant covers data, tensor and pipeline parallelism today, not {', '.join(bad)}: "
                  f"context and expert parallel reductions are not ordered yet (docs/determinism.md); "
                  f"drop {', '.join(bad)}")
    need(cfg.tp == 1 or cfg.invariant_tp,
         f"--layout-invariant with --tp {cfg.tp} needs --invariant-tp: the tensor-parallel sums are computed as "
         f"fixed chunks, and every run of the family (one process too) must compute them so; add --invariant-tp")
    need(cfg.tp in INVARIANT_TP, f"--layout-invariant computes tensor-parallel sums as {INVARIANT_TP[-1]} fixed "
                                 f"chunks, which --tp {cfg.tp} cannot share; use --tp "
                                 f"{', '.join(str(t) for t in INVARIANT_TP)}")
    need(cfg.tp == 1 or (cfg.strategy == "ddp" or (cfg.strategy == "diloco" and cfg.inner_strategy == "ddp"))
         and cfg.pp == 1,
         f"--layout-invariant with --tp {cfg.tp} covers --strategy ddp without --pp (ZeRO's flat shards of "
         f"tensor-parallel layers and tensor-parallel pipeline stages are not ordered yet); use --strategy ddp "
         f"and drop --pp")
    need(cfg.accum_steps == 1,
         f"--layout-invariant already accumulates: each replica runs its units of {cfg.batch_size // u} samples one "
         f"at a time; drop --accum-steps {cfg.accum_steps} and set --units (now {u})")
    need(cfg.compression is None, f"--layout-invariant sums gradients as integers; drop --compression {cfg.compression}")
    need(cfg.device != "cuda", "--layout-invariant is checked on CPU only (GPU kernels' batch invariance is not "
                               "verified here); use --device cpu")
    replicas = cfg.workers
    if cfg.strategy == "diloco":
        check_diloco(cfg, u)
    if cfg.pp > 1:
        check_pipeline(cfg, u, replicas)
    most = replicas
    if cfg.elastic:
        most = max(most, int(cfg.elastic.split(":")[1]))
    fit = min(d for d in range(min(most, cfg.batch_size), cfg.batch_size + 1) if cfg.batch_size % d == 0)
    need(most <= u, f"--layout-invariant: {most} data-parallel replicas cannot share {u} units (each needs at least "
                    f"one); use --units {fit}" + (" with a larger --batch-size" if most > cfg.batch_size else "")
                    + " or fewer ranks")
    need(cfg.strategy != "zero3" or u % replicas == 0,
         f"--layout-invariant with --strategy zero3: every replica must run the same number of units (its "
         f"all-gathers are collective), so {replicas} replicas must divide --units {u}; use --units "
         f"{replicas * max(1, u // replicas)} or another --nproc")


def check_pipeline(cfg, u: int, replicas: int) -> None:
    """--pp with --layout-invariant: a replica's micro-batches are its units of work, so every replica runs
    U / dp of them (its stages' collectives need the same count on every replica)."""
    need(cfg.strategy != "zero3",
         "--layout-invariant with --pp: zero3 does not run with a pipeline; use zero1 or zero2")
    need(u % replicas == 0,
         f"--layout-invariant with --pp {cfg.pp}: the micro-batches are the units of work, so {replicas} "
         f"data-parallel replicas must divide --units {u}; use --units {replicas * max(1, u // replicas)} "
         f"(with a --batch-size it divides) or another --dp")
    m = u // replicas
    need(cfg.microbatches == m,
         f"--layout-invariant with --pp {cfg.pp}: each replica's micro-batches are its units of work, so "
         f"--microbatches must be --units {u} / dp {replicas} = {m}; use --microbatches {m}")


def check_diloco(cfg, u: int) -> None:
    """--strategy diloco with --layout-invariant: each island trains U / K units (its ranks share them, as
    replicas share a step's units: at least one each, the check below), and the outer mean is an integer sum
    (parallel/diloco/exact.py), which neither a compressed wire nor an elastic job's changing islands keep."""
    k = cfg.islands or cfg.nproc
    # the --units that fit: multiples of K dividing the batch, at least one unit per rank
    fits = [d for d in range(max(k, cfg.nproc), cfg.batch_size + 1) if d % k == 0 and cfg.batch_size % d == 0]
    use = f"use --units {min(fits, key=lambda d: (abs(d - u), d))}" if fits else \
        f"use a --batch-size that a multiple of {max(k, cfg.nproc)} divides"
    need(u % k == 0,
         f"--layout-invariant with --strategy diloco: each of the {k} islands trains --units {u} / {k} of every "
         f"batch, so --islands {k} must divide --units; {use} or another --islands")
    need(cfg.outer_compression is None,
         f"--layout-invariant sums the islands' outer gradients as integers at shared exponents; drop "
         f"--outer-compression {cfg.outer_compression}")
    need(not cfg.elastic,
         f"--layout-invariant with --strategy diloco is not elastic (a lost island would move the units between "
         f"islands); drop --elastic {cfg.elastic}")
