"""``distrain bench wan``: the same training job with DDP and with DiLoCo's forms, across an emulated WAN.

The bench builds a cluster of its own (``nodes`` namespaces on links of ``link`` bits/s and ``delay``
one way, docs/cluster.md), runs ``distrain train --nproc NODES`` across it once per strategy (one rank
per node, so every node's link carries exactly its rank's traffic), reads each run folder
(bench/wan/report.py) and takes the cluster down, whatever happens. Every run has the same model, data,
steps, batch and seed, so every strategy trains on the same tokens; only the flags of its STRATEGIES
line differ.

Two options change what "the same job" starts from and how long the other strategies train:

* ``warm_start`` S > 0: first a DDP run of S steps across the same cluster (seed + 1, so that its batch
  order is not the one the measured runs then start again at step 0), and every strategy's run starts from
  its weights (``distrain train --init-from``: step 0, a fresh optimizer), as the DiLoCo paper starts from
  a synchronously trained model. The warm-up's time is no part of any measurement.
* ``target_budget`` F > 1: every strategy but DDP trains F × ``steps`` steps, so that its time to DDP's
  final loss can be measured where it takes more tokens than DDP's. Its loss at equal tokens is its
  evaluation after DDP's step count (report.records). That evaluation is the one of a run of ``steps``
  steps because nothing of the first ``steps`` steps depends on ``--steps``: the trainer's learning rate is
  constant (its default, which the bench keeps: a cosine schedule would decay over the longer run), the
  batch order is the seed's, and a DiLoCo run with ``steps`` a multiple of H has just synchronised there.
  Only an overlapped exchange (Streaming DiLoCo's ``--overlap-steps``) is settled at a run's last step
  alone, so those strategies are refused with F > 1.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from distrain.bench import common
from distrain.bench.wan import report
from distrain.cluster import netns, runner
from distrain.errors import ConfigError, TrainingError

# strategy -> its `distrain train` flags ({inner_steps} is filled in from the settings); one line per
# strategy, so a new DiLoCo form (streaming: --fragments, --overlap-steps) is one more line here
STRATEGIES: dict[str, tuple[str, ...]] = {
    "ddp": ("--strategy", "ddp"),
    "diloco": ("--strategy", "diloco", "--inner-steps", "{inner_steps}"),
    "diloco-bf16": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--outer-compression", "bf16"),
    "diloco-int8": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--outer-compression", "int8"),
    "diloco-int4": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--outer-compression", "int4"),
    # Streaming DiLoCo: 4 fragments at staggered offsets, each exchange overlapped with the next inner step
    "streaming": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--fragments", "4", "--overlap-steps", "1"),
    "streaming-bf16": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--fragments", "4",
                       "--overlap-steps", "1", "--outer-compression", "bf16"),
    "streaming-int4": ("--strategy", "diloco", "--inner-steps", "{inner_steps}", "--fragments", "4",
                       "--outer-compression", "int4"),  # (int8/int4 exchanges block: no overlap)
}
DEFAULT_STRATEGIES = ("ddp", "diloco", "diloco-int8", "diloco-int4")


@dataclass(frozen=True)
class Settings:
    nodes: int = 4
    link: str = "100mbit"
    delay: str = "25ms"
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    model: str = "gpt-small"
    data: str = "shakespeare"
    steps: int = 200
    batch_size: int = 16
    seed: int = 0
    lr: float | None = None  # None: distrain train's default
    inner_steps: int = 25
    eval_every: int = 25
    eval_batches: int = 8
    name: str = "dtwan"  # the cluster's name (its namespaces' prefix)
    timeout: float = 1800.0  # seconds one training run may take
    out: str | None = None  # the run folders (OUT/STRATEGY); None: a temporary folder, removed at the end
    json_path: str | None = None
    plot_path: str | None = None
    outer_lr: float | None = None  # DiLoCo's outer learning rate; None: distrain train's default
    outer_momentum: float | None = None  # DiLoCo's outer momentum; None: distrain train's default
    warm_start: int = 0  # steps of the DDP run every strategy starts from (0: from scratch)
    target_budget: int = 1  # every strategy but ddp trains target_budget x steps (its time to ddp's loss)
    extra: tuple[str, ...] = field(default_factory=tuple)  # more `distrain train` flags, the same for every run

    def steps_of(self, strategy: str) -> int:
        """The steps ``strategy``'s run trains: ``steps`` for the baseline, ``target_budget`` x that for the others."""
        return self.steps if strategy == report.BASELINE else self.steps * self.target_budget


WARM_START = "warm-start"  # the warm-up run's folder, beside the strategies' (OUT/warm-start)


def overlapped(strategy: str) -> bool:
    """Whether ``strategy``'s exchanges overlap inner steps (settled only at its run's last step)."""
    flags = STRATEGIES[strategy]
    return "--overlap-steps" in flags and flags[flags.index("--overlap-steps") + 1] != "0"


def check(s: Settings) -> netns.ClusterSpec:
    """Refuse bad settings in one line before any cluster or run exists; returns the cluster to build."""
    if s.nodes < 2:
        raise ConfigError(f"bench wan: --nodes {s.nodes}: the strategies differ only in what crosses the links "
                          f"between nodes; give at least 2")
    unknown = [x for x in s.strategies if x not in STRATEGIES]
    if unknown:
        raise ConfigError(f"bench wan: --strategies: unknown {', '.join(map(repr, unknown))}; choose from "
                          f"{', '.join(STRATEGIES)}")
    if report.BASELINE not in s.strategies:
        raise ConfigError(f"bench wan: --strategies must include {report.BASELINE}: every run's target is its final "
                          f"validation loss")
    if s.steps < 1 or s.batch_size < 1 or s.eval_batches < 1:
        raise ConfigError("bench wan: --steps, --batch-size and --eval-batches must be at least 1")
    if s.inner_steps < 1 or s.steps % s.inner_steps:
        raise ConfigError(f"bench wan: --steps {s.steps} must be a multiple of --inner-steps {s.inner_steps}, so that "
                          f"every DiLoCo run ends on an outer step (its final model is synchronised)")
    if not 1 <= s.eval_every <= s.steps:
        raise ConfigError(f"bench wan: --eval-every {s.eval_every} must be in [1, --steps {s.steps}]: the curves and "
                          f"the time to ddp's loss come from the evaluations")
    # (train's own checks, early: a run refused after ddp's minutes of training would waste them)
    if s.outer_lr is not None and not (math.isfinite(s.outer_lr) and s.outer_lr > 0):
        raise ConfigError(f"bench wan: --outer-lr {s.outer_lr:g} must be a positive finite number")
    if s.outer_momentum is not None and not (math.isfinite(s.outer_momentum) and 0 < s.outer_momentum < 1):
        raise ConfigError(f"bench wan: --outer-momentum {s.outer_momentum:g} must be in (0, 1): DiLoCo's Nesterov "
                          f"outer step needs momentum")
    if s.warm_start < 0:
        raise ConfigError(f"bench wan: --warm-start {s.warm_start} must be at least 0 (steps of the ddp run every "
                          f"strategy starts from; 0: from scratch)")
    if s.target_budget < 1:
        raise ConfigError(f"bench wan: --target-budget {s.target_budget} must be at least 1 (times ddp's steps that "
                          f"the other strategies train)")
    if s.target_budget > 1:
        if s.steps % s.eval_every:
            raise ConfigError(f"bench wan: --target-budget {s.target_budget} needs an evaluation after ddp's last "
                              f"step: give an --eval-every that divides --steps {s.steps}")
        late = [x for x in s.strategies if overlapped(x)]
        if late:
            raise ConfigError(f"bench wan: --target-budget {s.target_budget} with {', '.join(late)}: an overlapped "
                              f"exchange is settled only at a run's last step, so a longer run's model at ddp's "
                              f"step count is not the equal-token run's; run {', '.join(late)} with --target-budget 1")
        if "--lr-schedule" in s.extra:
            raise ConfigError(f"bench wan: --target-budget {s.target_budget} with --lr-schedule: a schedule over "
                              f"--steps differs in a longer run; keep the constant learning rate")
    if s.timeout <= 0:
        raise ConfigError(f"bench wan: --timeout {s.timeout:g} must be positive (seconds per run)")
    spec = netns.ClusterSpec.build(s.name, s.nodes, s.link, delay=s.delay)  # (bad --link/--delay/--name: one line)
    if s.plot_path:
        common.require_pyplot()  # before the runs, not after them
    reason = netns.unavailable_reason()
    if reason:
        raise netns.ClusterError(f"bench wan: {reason}")
    return spec


def train_command(s: Settings, strategy: str, out: Path, init_from: Path | None = None) -> list[str]:
    """The ``distrain train`` command line of ``strategy``'s run, as every node runs it (from the weights of
    the run folder ``init_from`` when given: the warm start)."""
    flags = [f.format(inner_steps=s.inner_steps) for f in STRATEGIES[strategy]]
    if "diloco" in flags:  # (ddp refuses the outer flags)
        flags += [*(["--outer-lr", repr(s.outer_lr)] if s.outer_lr is not None else []),
                  *(["--outer-momentum", repr(s.outer_momentum)] if s.outer_momentum is not None else [])]
    lr = ["--lr", repr(s.lr)] if s.lr is not None else []
    init = ["--init-from", str(init_from)] if init_from is not None else []
    return ["distrain", "train", "--nproc", str(s.nodes), *flags, "--model", s.model, "--data", s.data, *init,
            "--steps", str(s.steps_of(strategy)), "--batch-size", str(s.batch_size), "--seed", str(s.seed), *lr,
            "--eval-every", str(s.eval_every), "--eval-batches", str(s.eval_batches), "--log-every",
            str(s.eval_every), "--ckpt-every", "0", "--sample-chars", "0", "--no-progress", "--no-report",
            "--out", str(out), "--overwrite", *s.extra]


def warm_command(s: Settings, out: Path) -> list[str]:
    """The ``distrain train`` command line of the warm-up: DDP for ``warm_start`` steps (seed + 1: another
    batch order than the measured runs', which start again at step 0), its checkpoint at the end."""
    return train_command(replace(s, steps=s.warm_start, seed=s.seed + 1, target_budget=1), report.BASELINE, out)


def title(s: Settings) -> str:
    warm = f" from a {s.warm_start}-step ddp run" if s.warm_start else ""
    longer = f" (the others up to {s.steps * s.target_budget})" if s.target_budget > 1 else ""
    outer = "".join(f", outer {k} {v:g}" for k, v in (("lr", s.outer_lr), ("momentum", s.outer_momentum))
                    if v is not None)
    return (f"bench wan: {s.nodes} nodes, {s.link} links, {s.delay} one way; {s.model} on {s.data}{warm}, "
            f"{s.steps} steps{longer} of batch {s.batch_size}, DiLoCo H={s.inner_steps}{outer}")


def _train(spec: netns.ClusterSpec, s: Settings, what: str, cmd: list[str]) -> None:
    """Run ``cmd`` across the cluster; a TrainingError with the failing node's last lines if it fails."""
    res = runner.run(spec, cmd, timeout=s.timeout, echo=False)
    if res.returncode != 0:
        bad = res.first_failure
        tail = "\n".join(res.output[-8:])
        raise TrainingError(f"bench wan: the {what} run failed (node {bad.node}: {bad.describe()}):\n{tail}")


def run(s: Settings) -> list[dict]:
    """Build the cluster, train once per strategy across it, write the records (and figure), take it down."""
    spec = check(s)
    folder = Path(s.out) if s.out else Path(tempfile.mkdtemp(prefix="distrain-bench-wan-"))
    runs: list[report.Run] = []
    netns.up(spec)
    try:
        common.progress(f"bench wan: cluster {spec.name} up: {s.nodes} nodes, {s.link}, {s.delay} one way")
        warm = folder / WARM_START if s.warm_start else None
        if warm is not None:
            cmd = warm_command(s, warm)
            common.progress(f"[warm start] {' '.join(cmd)}")
            _train(spec, s, "warm-up", cmd)
            warm_loss = report.read_run(warm, WARM_START).curve[-1].val_loss
            common.progress(f"[warm start] ddp, {s.warm_start} steps: validation loss {warm_loss:.4f}")
        for i, strategy in enumerate(s.strategies):
            out = folder / strategy
            cmd = train_command(s, strategy, out, warm)
            common.progress(f"[{i + 1}/{len(s.strategies)}] {strategy}: {' '.join(cmd)}")
            _train(spec, s, strategy, cmd)
            runs.append(report.read_run(out, strategy))
            r = runs[-1]
            common.progress(f"[{i + 1}/{len(s.strategies)}] {strategy}: validation loss {r.curve[-1].val_loss:.4f}, "
                            f"{r.wall_s:.1f} s of steps, {r.bytes_per_node:,} bytes sent per node")
    finally:
        netns.down(spec.name)
        if not s.out:
            shutil.rmtree(folder, ignore_errors=True)
    recs = report.records(runs)
    print(report.format_table(recs, title=title(s)))
    print(report.format_targets(recs))
    if s.json_path:
        cluster = {"nodes": spec.nodes, "link_bits_per_s": spec.links[0], "delay_us_one_way": spec.delays_us[0],
                   "rtt_ms": 2 * spec.delays_us[0] / 1000, "mtu": spec.mtu}
        warm = Path("OUT") / WARM_START if s.warm_start else None
        meta = common.metadata(settings=asdict(s), cluster=cluster,
                               warm_start_command=warm_command(s, warm) if warm else None,
                               warm_start_val_loss=warm_loss if warm else None,
                               train_commands={x: train_command(s, x, Path("OUT") / x, warm) for x in s.strategies},
                               targets=report.targets(recs))
        common.write_json(s.json_path, meta, recs)
    if s.plot_path:
        report.plot(recs, s.plot_path, title(s))
    return recs
