"""What ``distrain bench wan`` reads from each run folder, and what it writes: records, table, targets, figure.

Everything here is a pure function of files a ``distrain train --out`` folder holds (or of the records
made from them), so it is tested without a cluster. Definitions (one run = one strategy):

* **the curve**: every metrics.jsonl step line that carries ``val_loss``, as a point (step, tokens,
  seconds, val_loss). ``tokens`` is the tokens trained on after that step, ``(step + 1) × tokens per
  step``; ``seconds`` is the sum of the ``time_s`` of the steps up to it (each step's wall time, from
  loading its batch to the end of its optimizer steps, the outer step included): the training's wall
  time with the evaluations, logging and checkpoints between steps left out, which every strategy pays
  alike at the same steps.
* ``wall_s``: that sum over every step; ``run_s``: the training loop's own wall time (summary.json's
  ``wall_s``: evaluations and log writes included).
* ``bytes_per_node``: the bytes rank 0 sent over the whole run, by its traffic ledger (summary.json's
  ``bytes_sent_per_step_rank0`` × steps). With one rank per node, that is what its node sent over its link.
* ``compute_utilisation``: 1 − Σ comm_wait_s / Σ time_s over every step: the share of the step not spent
  waiting on communication (DDP: on its gradient buckets' all-reduce after backward; DiLoCo with one rank
  per island: on the outer step's exchange). None when the engine does not measure its wait.
* **equal tokens**: DDP's step count. A run may train longer than DDP (``bench wan --target-budget F``:
  F × DDP's steps) so that its time to DDP's loss can be measured; its loss, bytes and wall time at
  equal tokens are then those of its evaluation after DDP's last step (``val_loss_equal_tokens``,
  ``bytes_per_node``, ``wall_s_equal_tokens``), and ``final_val_loss``, ``bytes_per_node_run`` and
  ``wall_s`` are those of its whole run (the same numbers when it trained DDP's steps).
* ``seconds_to_target``: ``seconds`` at the first evaluation whose val_loss is at or below the target
  (DDP's final validation loss), None when no evaluation reaches it; its resolution is ``--eval-every``.
  ``steps_to_target`` and ``tokens_to_target`` are that evaluation's steps done and tokens.
  ``ddp_seconds_to_this_loss`` is the converse: DDP's seconds to this run's loss at equal tokens (None
  when DDP never got that low), so a run that ends above DDP's loss still gets a time for equal quality.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from distrain.bench import common
from distrain.errors import TrainingError

BASELINE = "ddp"  # the strategy whose final validation loss is every run's target
# the targets for a DiLoCo form against DDP (docs/slow_links.md, "Across a slow WAN")
LOSS_WITHIN = 0.02  # final validation loss at most 2 % above DDP's, at equal tokens
FEWER_BYTES = 100.0  # at least 100x fewer bytes per node
FASTER_TO_TARGET = 5.0  # at least 5x less wall time to DDP's final validation loss


@dataclass(frozen=True)
class Point:
    step: int  # the step (from 0) after which the evaluation ran
    tokens: int  # tokens trained on up to and including that step
    seconds: float  # sum of the steps' time_s up to and including it
    val_loss: float


@dataclass(frozen=True)
class Run:
    strategy: str
    label: str  # the trainer's name for it, e.g. "diloco (K=4×1, H=25)"
    steps: int
    tokens_per_step: int
    curve: tuple[Point, ...]
    wall_s: float
    run_s: float
    bytes_per_node: int
    compute_utilisation: float | None
    outer_syncs: int | None  # DiLoCo's outer steps (None for other strategies)


def _number(row: dict, key: str, where: str) -> float:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise TrainingError(f"bench wan: {where}: {key} is {v!r}, not a finite number")
    return float(v)


def read_run(folder: str | Path, strategy: str) -> Run:
    """The run of ``strategy`` in the ``distrain train --out`` folder ``folder`` (a TrainingError names
    what is missing or malformed: these files come from another process)."""
    folder = Path(folder)
    try:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        summary = json.loads((folder / "summary.json").read_text())
        rows = [json.loads(ln) for ln in lines if ln.strip()]
    except (OSError, ValueError) as e:
        raise TrainingError(f"bench wan: {strategy}: cannot read the run in {folder}: {e}") from None
    steps = [r for r in rows if isinstance(r, dict) and "event" not in r]
    where = f"{strategy} ({folder / 'metrics.jsonl'})"
    if not steps or [r.get("step") for r in steps] != list(range(len(steps))):
        raise TrainingError(f"bench wan: {where}: expected one line per step 0, 1, 2, ...")
    if summary.get("steps") != len(steps):
        raise TrainingError(f"bench wan: {where}: {len(steps)} step lines, summary.json says {summary.get('steps')!r}")
    times = [_number(r, "time_s", where) for r in steps]
    per_step = round(_number(steps[0], "tokens_per_s", where) * times[0])  # (the trainer's tokens / time_s)
    curve, elapsed = [], 0.0
    for r, t in zip(steps, times):
        elapsed += t
        if "val_loss" in r:
            curve.append(Point(r["step"], (r["step"] + 1) * per_step, elapsed, _number(r, "val_loss", where)))
    if not curve or curve[-1].step != len(steps) - 1:
        raise TrainingError(f"bench wan: {where}: no validation loss after the last step; run with --eval-every")
    waits = [r.get("comm_wait_s") for r in steps]
    util = None if any(w is None for w in waits) else 1.0 - sum(_number(r, "comm_wait_s", where) for r in steps) / sum(times)
    sent = _number(summary, "bytes_sent_per_step_rank0", where)
    return Run(strategy=strategy, label=str(summary.get("label", strategy)), steps=len(steps), tokens_per_step=per_step,
               curve=tuple(curve), wall_s=sum(times), run_s=_number(summary, "wall_s", where),
               bytes_per_node=round(sent * len(steps)), compute_utilisation=util,
               outer_syncs=summary.get("outer_syncs"))


def seconds_to_target(curve: tuple[Point, ...] | list[Point], target: float) -> float | None:
    """``seconds`` of the first point whose val_loss is at or below ``target``; None when none is."""
    p = point_at_or_below(curve, target)
    return None if p is None else p.seconds


def point_at_or_below(curve: tuple[Point, ...] | list[Point], target: float) -> Point | None:
    """The first point whose val_loss is at or below ``target``; None when none is."""
    return next((p for p in curve if p.val_loss <= target), None)


def records(runs: list[Run]) -> list[dict]:
    """One JSON record per run, against the BASELINE run's final validation loss (which must be among them).

    Equal tokens are the BASELINE's steps: every other run trained at least as many and has an evaluation
    after the BASELINE's last step (a ValueError says which does not)."""
    base = next((r for r in runs if r.strategy == BASELINE), None)
    if base is None:
        raise ValueError(f"records: no {BASELINE} run to take the target from")
    target, steps = base.curve[-1].val_loss, base.steps
    base_s = seconds_to_target(base.curve, target)
    out = []
    for r in runs:
        equal = next((p for p in r.curve if p.step == steps - 1), None)
        if equal is None or r.steps < steps:
            raise ValueError(f"records: {r.strategy} has no evaluation after step {steps - 1} ({BASELINE}'s last): "
                             f"its loss at equal tokens is unknown")
        reached = point_at_or_below(r.curve, target)
        to_target = None if reached is None else reached.seconds
        # (every DiLoCo sync sends the same bytes and --steps is a multiple of H: exact at equal tokens)
        sent = round(r.bytes_per_node * steps / r.steps)
        out.append({
            "strategy": r.strategy, "label": r.label, "steps": steps, "tokens": steps * r.tokens_per_step,
            "steps_run": r.steps, "tokens_run": r.steps * r.tokens_per_step,
            "val_loss_equal_tokens": equal.val_loss, "final_val_loss": r.curve[-1].val_loss,
            "target_val_loss": target, "val_loss_vs_ddp": equal.val_loss / target - 1.0,
            "bytes_per_node": sent, "bytes_per_node_run": r.bytes_per_node,
            "fewer_bytes_than_ddp": base.bytes_per_node / sent if sent else None,
            "wall_s": r.wall_s, "wall_s_equal_tokens": equal.seconds, "run_s": r.run_s,
            "seconds_to_target": to_target,
            "steps_to_target": None if reached is None else reached.step + 1,
            "tokens_to_target": None if reached is None else reached.tokens,
            "faster_to_target_than_ddp": base_s / to_target if to_target else None,
            # the other way round: when did ddp reach this run's loss at equal tokens (its time for the same quality)
            "ddp_seconds_to_this_loss": seconds_to_target(base.curve, equal.val_loss),
            "compute_utilisation": r.compute_utilisation, "outer_syncs": r.outer_syncs,
            "curve": [{"step": p.step, "tokens": p.tokens, "seconds": p.seconds, "val_loss": p.val_loss}
                      for p in r.curve],
        })
    return out


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}x"


def format_table(recs: list[dict], title: str | None = None) -> str:
    """The records as a fixed-width table, one row per strategy: loss, bytes and wall time at equal tokens,
    time to DDP's loss; where a run trained past DDP's steps, also the steps to DDP's loss, the steps run and
    the whole run's wall time."""
    longer = any(r["steps_run"] != r["steps"] for r in recs)
    rows = [[r["strategy"], f"{r['val_loss_equal_tokens']:.4f}", f"{100 * r['val_loss_vs_ddp']:+.2f}%",
             f"{r['bytes_per_node']:,}", _ratio(r["fewer_bytes_than_ddp"]), f"{r['wall_s_equal_tokens']:.1f}",
             common.fmt_num(r["seconds_to_target"], 1), _ratio(r["faster_to_target_than_ddp"]),
             common.fmt_num(None if r["compute_utilisation"] is None else 100 * r["compute_utilisation"], 0)]
            + ([common.fmt_num(r["steps_to_target"], 0), str(r["steps_run"]), f"{r['wall_s']:.1f}"] if longer else [])
            for r in recs]
    groups = [("", ["strategy"]), ("validation loss", ["equal tok", "vs ddp"]),
              ("bytes per node", ["sent", "ddp/this"]), ("wall s", ["equal tok", "to ddp's"]),
              ("", ["speed-up", "compute %"])]
    if longer:
        groups.append(("longer run", ["steps to ddp's", "steps", "wall s"]))
    return common.format_table(groups, rows, title=title)


def targets(recs: list[dict]) -> list[dict]:
    """Per non-baseline record, the issue's three targets: each a bool, with the measured value."""
    return [{"strategy": r["strategy"],
             "loss_within_2pct": r["val_loss_vs_ddp"] <= LOSS_WITHIN,
             "bytes_100x": (r["fewer_bytes_than_ddp"] or 0) >= FEWER_BYTES,
             "time_5x": (r["faster_to_target_than_ddp"] or 0) >= FASTER_TO_TARGET}
            for r in recs if r["strategy"] != BASELINE]


def format_targets(recs: list[dict]) -> str:
    """One line per DiLoCo form: which of the three targets hold, with the numbers, and whether any form
    meets all three."""
    by = {r["strategy"]: r for r in recs}
    lines = []
    for t in targets(recs):
        r = by[t["strategy"]]
        longer = r["steps_run"] != r["steps"]
        within = f" in {r['steps_run']} steps, {r['steps_run'] / r['steps']:g}x ddp's" if longer else ""
        if r["seconds_to_target"] is not None:
            time_text = f"{_ratio(r['faster_to_target_than_ddp'])} less wall time to ddp's loss"
            if longer:
                time_text += f", reached after {r['steps_to_target']} steps"
        elif r["ddp_seconds_to_this_loss"] is not None:
            time_text = (f"ddp's final loss never reached{within}; ddp took {r['ddp_seconds_to_this_loss']:.1f} s to "
                         f"this run's {'equal-token' if longer else 'final'} loss, "
                         f"{_ratio(r['ddp_seconds_to_this_loss'] / r['wall_s_equal_tokens'])} this run's "
                         f"{r['wall_s_equal_tokens']:.1f} s")
        else:
            time_text = f"ddp's final loss never reached{within}"
        mark = ["no", "yes"]
        lines.append(f"  {t['strategy']}: loss within 2 %: {mark[t['loss_within_2pct']]} "
                     f"({100 * r['val_loss_vs_ddp']:+.2f}%); >= 100x fewer bytes: {mark[t['bytes_100x']]} "
                     f"({_ratio(r['fewer_bytes_than_ddp'])}); >= 5x less wall time: {mark[t['time_5x']]} "
                     f"({time_text})")
    met = [t["strategy"] for t in targets(recs) if t["loss_within_2pct"] and t["bytes_100x"] and t["time_5x"]]
    lines.append(f"  all three: {', '.join(met) if met else 'no strategy'}")
    return "# targets (against ddp)\n" + "\n".join(lines)


def plot(recs: list[dict], path: str, title: str) -> None:
    """Validation loss against tokens and against wall time, and bytes per node, as one PNG."""
    plt = common.require_pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.5))
    for r in recs:
        tokens = [p["tokens"] / 1e3 for p in r["curve"]]
        seconds = [p["seconds"] for p in r["curve"]]
        losses = [p["val_loss"] for p in r["curve"]]
        a.plot(tokens, losses, marker=".", label=r["strategy"])
        b.plot(seconds, losses, marker=".", label=r["strategy"])
    target = recs[0]["target_val_loss"]
    for ax, xlabel in ((a, "tokens (thousands)"), (b, "wall time of the training steps (s)")):
        ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="ddp's final")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    c.bar([r["strategy"] for r in recs], [r["bytes_per_node"] for r in recs], color="tab:blue")
    c.set_yscale("log")
    c.set_ylabel("bytes sent per node, up to ddp's tokens")
    c.tick_params(axis="x", labelrotation=30)
    c.grid(alpha=0.3, axis="y")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
