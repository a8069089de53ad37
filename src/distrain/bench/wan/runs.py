"""``distrain bench wan``: the same training job with DDP and with DiLoCo's forms, across an emulated WAN.

The bench builds a cluster of its own (``nodes`` namespaces on links of ``link`` bits/s and ``delay``
one way, docs/cluster.md), runs ``distrain train --nproc NODES`` across it once per strategy (one rank
per node, so every node's link carries exactly its rank's traffic), reads each run folder
(bench/wan/report.py) and takes the cluster down, whatever happens. Every run has the same model, data,
steps, batch and seed, so every strategy trains on the same tokens; only the flags of its STRATEGIES
line differ.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import asdict, dataclass, field
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
    extra: tuple[str, ...] = field(default_factory=tuple)  # more `distrain train` flags, the same for every run


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
    if s.timeout <= 0:
        raise ConfigError(f"bench wan: --timeout {s.timeout:g} must be positive (seconds per run)")
    spec = netns.ClusterSpec.build(s.name, s.nodes, s.link, delay=s.delay)  # (bad --link/--delay/--name: one line)
    if s.plot_path:
        common.require_pyplot()  # before the runs, not after them
    reason = netns.unavailable_reason()
    if reason:
        raise netns.ClusterError(f"bench wan: {reason}")
    return spec


def train_command(s: Settings, strategy: str, out: Path) -> list[str]:
    """The ``distrain train`` command line of ``strategy``'s run, as every node runs it."""
    flags = [f.format(inner_steps=s.inner_steps) for f in STRATEGIES[strategy]]
    lr = ["--lr", repr(s.lr)] if s.lr is not None else []
    return ["distrain", "train", "--nproc", str(s.nodes), *flags, "--model", s.model, "--data", s.data,
            "--steps", str(s.steps), "--batch-size", str(s.batch_size), "--seed", str(s.seed), *lr,
            "--eval-every", str(s.eval_every), "--eval-batches", str(s.eval_batches), "--log-every",
            str(s.eval_every), "--ckpt-every", "0", "--sample-chars", "0", "--no-progress", "--no-report",
            "--out", str(out), "--overwrite", *s.extra]


def title(s: Settings) -> str:
    return (f"bench wan: {s.nodes} nodes, {s.link} links, {s.delay} one way; {s.model} on {s.data}, "
            f"{s.steps} steps of batch {s.batch_size}, DiLoCo H={s.inner_steps}")


def run(s: Settings) -> list[dict]:
    """Build the cluster, train once per strategy across it, write the records (and figure), take it down."""
    spec = check(s)
    folder = Path(s.out) if s.out else Path(tempfile.mkdtemp(prefix="distrain-bench-wan-"))
    runs: list[report.Run] = []
    netns.up(spec)
    try:
        common.progress(f"bench wan: cluster {spec.name} up: {s.nodes} nodes, {s.link}, {s.delay} one way")
        for i, strategy in enumerate(s.strategies):
            out = folder / strategy
            cmd = train_command(s, strategy, out)
            common.progress(f"[{i + 1}/{len(s.strategies)}] {strategy}: {' '.join(cmd)}")
            res = runner.run(spec, cmd, timeout=s.timeout, echo=False)
            if res.returncode != 0:
                bad = res.first_failure
                tail = "\n".join(res.output[-8:])
                raise TrainingError(f"bench wan: the {strategy} run failed (node {bad.node}: {bad.describe()}):\n"
                                    f"{tail}")
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
        meta = common.metadata(settings=asdict(s), cluster=cluster,
                               train_commands={x: train_command(s, x, Path("OUT") / x) for x in s.strategies},
                               targets=report.targets(recs))
        common.write_json(s.json_path, meta, recs)
    if s.plot_path:
        report.plot(recs, s.plot_path, title(s))
    return recs
