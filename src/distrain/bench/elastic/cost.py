"""The cost of ``--elastic``: per step when nothing fails, and the time to recover and to join.

Every measurement is a real ``distrain train`` run in a subprocess, as a user starts it:

* **steady state**: the fixed job and the same job with ``--elastic P-1:P`` (no fault), alternated
  ``rounds`` times; a run's step time is the median wall time between consecutive metrics lines'
  ``time`` stamps after ``warmup`` steps (every line is one step: ``--log-every`` does not batch the
  stamps, each is taken when its step ends), so it includes everything the loop does per step (an
  elastic job's quorum too). The ratio elastic / fixed is taken per round, and its median reported.
* **recovery**: ``--elastic P-1:P`` with rank id 1 SIGKILLed at the start of step ``kill_step``
  (DISTRAIN_ELASTIC_FAULTS); the membership line's ``recover_s`` (from the coordinator seeing the
  loss to the first step done at the new size) and the steps redone.
* **join**: the same kill with ``--elastic-replace 1``: a replacement is started when the rank dies
  and joins the survivors (in the loss's change when it is ready by then, else in one of its own);
  ``join_s`` (from its start to its first step done in the group).

``faults=False`` (``--no-faults``) runs the steady state only: e.g. ZeRO at P = 2, whose loss of a rank leaves
dp = 1, which ZeRO refuses.

The job's flags (model, data, batch, dtype, strategy, ...) are the same in every run. Results: a
table, and with ``json_path`` every record beside the machine's metadata (bench/common.py).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from distrain.bench import common
from distrain.errors import ConfigError
from distrain.elastic.spec import SUPPORTED

KILLED = 1  # the rank id killed in the recovery and join runs


@dataclass(frozen=True)
class Settings:
    nproc: int = 4
    strategy: str = "ddp"
    model: str = "gpt-small"
    data: str = "shakespeare"
    steps: int = 80
    warmup: int = 5
    batch_size: int = 16
    dtype: str = "float32"
    rounds: int = 6
    kill_step: int = 30
    log_every: int = 10
    transport: str = "torch"  # --transport of every run (torch, shm or auto)
    faults: bool = True  # the recovery and join runs after the steady state
    extra: tuple[str, ...] = field(default_factory=tuple)  # more `distrain train` flags, the same for every run
    json_path: str | None = None


def check(s: Settings) -> None:
    """One-line errors before any run starts."""
    if s.strategy not in SUPPORTED:
        raise ConfigError(f"bench elastic: --strategy {s.strategy} has no elastic form; use one of "
                          f"{', '.join(SUPPORTED)}")
    if s.nproc < 2:
        raise ConfigError(f"bench elastic: --nproc {s.nproc}: an elastic job needs at least 2 ranks to lose one")
    if not 0 < s.warmup < s.steps - 2:
        raise ConfigError(f"bench elastic: --warmup {s.warmup} must leave timed steps of --steps {s.steps}")
    if s.faults and not s.warmup <= s.kill_step < s.steps - 2:
        raise ConfigError(f"bench elastic: --kill-step {s.kill_step} must be after the warm-up ({s.warmup}) and at "
                          f"least 2 steps before the end (--steps {s.steps})")
    if s.rounds < 1:
        raise ConfigError(f"bench elastic: --rounds {s.rounds} must be at least 1")


def _train(s: Settings, out: Path, elastic: str | None, faults: str = "", replace: int = 0) -> float:
    """One ``distrain train`` run into ``out``; returns its wall time. Raises on failure with its stderr."""
    cmd = [sys.executable, "-m", "distrain", "train", "--nproc", str(s.nproc), "--strategy", s.strategy,
           "--model", s.model, "--data", s.data, "--steps", str(s.steps), "--batch-size", str(s.batch_size),
           "--dtype", s.dtype, "--eval-every", "0", "--sample-chars", "0", "--no-progress", "--no-report",
           "--log-every", str(s.log_every), "--ckpt-every", "0", "--out", str(out), "--overwrite",
           "--transport", s.transport, *s.extra]
    if elastic:
        cmd += ["--elastic", elastic, "--collective-timeout", "60"]
    if replace:
        cmd += ["--elastic-replace", str(replace)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["DISTRAIN_ELASTIC_FAULTS"] = faults
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH")]))  # (--model pkg:fn)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-5:])
        raise ConfigError(f"bench elastic: `{' '.join(cmd[2:])}` failed (exit {p.returncode}):\n{tail}")
    return time.perf_counter() - t0


def _lines(out: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    return [r for r in rows if "event" not in r], [r for r in rows if r.get("event") == "membership"]


def step_time(out: Path, warmup: int) -> float:
    """Median seconds between consecutive step lines' end stamps, after ``warmup`` steps."""
    steps, _ = _lines(out)
    stamps = [r["time"] for r in steps[warmup:]]
    return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def guard_time(out: Path, warmup: int) -> float | None:
    """Median seconds rank 0 spent in the elastic guard's calls per step (the step lines' ``guard_s``), after
    ``warmup`` steps; None for a fixed job's lines."""
    steps, _ = _lines(out)
    spent = [r["guard_s"] for r in steps[warmup:] if "guard_s" in r]
    return statistics.median(spent) if spent else None


def run(s: Settings) -> dict:
    check(s)
    records: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="distrain-bench-elastic-") as tmp:
        out = Path(tmp) / "run"
        for r in range(s.rounds):  # fixed and elastic alternated, so the machine's drift hits both alike
            pair = {}
            for kind, elastic in (("fixed", None), ("elastic", f"{s.nproc - 1}:{s.nproc}")):
                _train(s, out, elastic)
                pair[kind] = step_time(out, s.warmup)
                guard = guard_time(out, s.warmup)
                records.append({"what": "steady", "round": r, "kind": kind, "step_s": pair[kind], "guard_s": guard})
                common.progress(f"round {r + 1}/{s.rounds}: {kind} {1e3 * pair[kind]:.2f} ms per step" +
                                (f" (the guard's {1e3 * guard:.2f} ms)" if guard is not None else ""))
            records.append({"what": "ratio", "round": r, "elastic_over_fixed": pair["elastic"] / pair["fixed"]})
        for kind, replace in (("recovery", 0), ("join", 1)) if s.faults else ():
            _train(s, out, f"{s.nproc - 1}:{s.nproc}", faults=f"{KILLED}@{s.kill_step}", replace=replace)
            steps, events = _lines(out)
            # the loss's change; a replacement joins in it, or (when it was not ready yet) in a change of its own
            e = next((e for e in events if e["joined"]), events[0]) if replace else events[0]
            records.append({"what": kind, "recover_s": e["recover_s"], "pause_s": e["pause_s"],
                            "join_s": e.get("join_s"), "step": e["step"], "rolled_back": e["rolled_back"],
                            "left": e["left"], "joined": e["joined"], "new_world": e["new_world"],
                            "changes": len(events), "step_s": step_time(out, s.warmup)})
            common.progress(f"{kind}: recover {e['recover_s']:.3f} s" +
                            (f", join {e['join_s']:.3f} s" if e.get("join_s") is not None else ""))
    summary = summarize(records)
    print(format_report(s, summary))
    if s.json_path:
        common.write_json(s.json_path, common.metadata(settings=asdict(s), summary=summary), records)
    return summary


def summarize(records: list[dict]) -> dict:
    ratios = [r["elastic_over_fixed"] for r in records if r["what"] == "ratio"]
    fixed = [r["step_s"] for r in records if r["what"] == "steady" and r["kind"] == "fixed"]
    elastic = [r["step_s"] for r in records if r["what"] == "steady" and r["kind"] == "elastic"]
    guards = [r["guard_s"] for r in records if r["what"] == "steady" and r.get("guard_s") is not None]
    out = {"ratio_median": statistics.median(ratios), "ratios": ratios, "fixed_step_s": statistics.median(fixed),
           "elastic_step_s": statistics.median(elastic)}
    if guards:  # (rank 0's time in the guard's calls per step, each elastic run's median: records that have it)
        out.update(guard_s=guards, guard_s_median=statistics.median(guards))
    rec = next((r for r in records if r["what"] == "recovery"), None)
    join = next((r for r in records if r["what"] == "join"), None)
    if rec is None or join is None:  # (--no-faults)
        return out
    return out | {"recover_s": rec["recover_s"], "redone": rec["rolled_back"] is not None, "join_s": join["join_s"],
                  "join_recover_s": join["recover_s"], "join_changes": join["changes"]}


def _join(m: dict) -> str:
    if m["join_s"] is None:  # the run ended before the replacement was ready
        return "none: the replacement had not joined when the run ended (give more --steps after --kill-step)"
    return f"{m['join_s']:.3f} s" + (f" (kill to the first step with it: {m['join_recover_s']:.3f} s)"
                                     if m["join_changes"] == 1 else " (a change of its own, after the loss's)")


def format_report(s: Settings, m: dict) -> str:
    rows = [("per step, fixed / elastic (medians)", f"{1e3 * m['fixed_step_s']:.2f} ms / {1e3 * m['elastic_step_s']:.2f} ms"),
            ("elastic / fixed, per round", ", ".join(f"{x:.3f}" for x in m["ratios"])),
            ("elastic / fixed, median", f"{m['ratio_median']:.3f}")]
    if m.get("guard_s_median") is not None:  # (rank 0's time in the guard's calls, per step: load moves it less)
        rows += [("the guard's work per step, rank 0, per round", ", ".join(f"{1e3 * x:.2f}" for x in m["guard_s"])),
                 ("the guard's work per step, median", f"{1e3 * m['guard_s_median']:.2f} ms")]
    if "recover_s" in m:
        rows += [(f"rank {KILLED} killed at step {s.kill_step}: to the first step at {s.nproc - 1}",
                  f"{m['recover_s']:.3f} s" + (" (the step cut in half redone)" if m["redone"] else "")),
                 ("killed and replaced: the replacement's join", _join(m))]
    width = max(len(k) for k, _ in rows)
    head = (f"bench elastic: {s.strategy}, P={s.nproc}, {s.model} on {s.data}, batch {s.batch_size}, {s.dtype}, "
            f"transport {s.transport}")
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])
