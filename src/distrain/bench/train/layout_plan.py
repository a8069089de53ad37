"""The layouts of ``distrain bench layouts``: ``--layouts`` items parsed into strategy and grid
degrees, and the jobs (P, layout) planned from them, with notes on what was skipped or merged.

A layout is ``ddp``, ``zero1``/``zero2``/``zero3`` (ZeRO over all P ranks), or a grid
``dpAxcpDxtpBxppC`` (any of the four parts, any order; cp: context parallelism, its attention
``Settings.cp_algorithm``), optionally after a strategy (``zero1xpp2``), and ``epE`` (expert
parallelism for a mixture-of-experts model: it borrows E of the dp x cp ranks, no ranks of its
own). A grid without ``dp`` fills the job with data parallelism, dp = P / (cp * tp * pp). ``single`` (one
process, P = 1) is always the first job, the baseline of the speedup.
"""

from __future__ import annotations

import dataclasses
import re

from distrain.bench.common import split_csv
from distrain.errors import ConfigError

STRATEGY_WORDS = ("ddp", "zero1", "zero2", "zero3")
_PART = re.compile(r"^(dp|tp|pp|cp|ep)(\d+)$")


@dataclasses.dataclass(frozen=True)
class Layout:
    """A parsed ``--layouts`` item: a strategy and the grid degrees it names (dp None: fill P)."""

    name: str
    strategy: str = "ddp"
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def grid(self, nproc: int) -> tuple[int, int, int, int, int] | None:
        """(dp, tp, pp, cp, ep) at ``nproc`` ranks, or None when the layout does not fit."""
        mp = self.tp * self.pp * self.cp
        dp = self.dp if self.dp is not None else (nproc // mp if nproc % mp == 0 else None)
        if dp is None or dp * mp != nproc or (dp * self.cp) % self.ep:
            return None
        return (dp, self.tp, self.pp, self.cp, self.ep)

    def misfit(self, nproc: int) -> str:
        """Why the layout does not fit ``nproc`` ranks (one line)."""
        names = "dp*cp*tp*pp" if self.cp > 1 else "dp*tp*pp"
        mp = self.tp * self.pp * self.cp
        dp = self.dp if self.dp is not None else nproc // mp
        if dp * mp == nproc and (dp * self.cp) % self.ep:
            return f"{self.name}: ep{self.ep} does not divide dp*cp = {dp * self.cp} at P={nproc}; skipped"
        if self.dp is not None:
            need = self.dp * self.tp * self.pp * self.cp
            return f"{self.name} needs exactly {names} = {need} processes; skipped at P={nproc}"
        return (f"{self.name}: {names[3:]} = {self.tp * self.pp * self.cp} does not divide P={nproc}; "
                f"skipped at P={nproc}")


def parse_layout(text: str) -> Layout:
    """``ddp``, ``zero3``, ``tp2``, ``dp2xtp2``, ``zero1xpp2``, ... -> Layout; else a ConfigError saying why."""
    name = text.strip().lower()
    hint = ("a layout is ddp, zero1, zero2, zero3, or dpAxcpDxtpBxppC parts joined by 'x' (e.g. tp2, pp2, cp2, "
            "dp2xtp2, tp2xpp2), optionally after a strategy (zero1xpp2)")
    if not name:
        raise ConfigError(f"--layouts: empty layout name; {hint}")
    parts = name.split("x")
    if any(not p for p in parts):
        where = "at the end" if not parts[-1] else "at the start" if not parts[0] else "between two 'x'"
        raise ConfigError(f"--layouts: {text!r} has an empty part {where}; {hint}")
    strategy = "ddp"
    if parts[0] in STRATEGY_WORDS:
        strategy, parts = parts[0], parts[1:]
    degrees: dict[str, int] = {}
    for p in parts:
        m = _PART.match(p)
        if not m:
            bad = "a strategy must come first" if p in STRATEGY_WORDS else "not dpN, tpN or ppN (or cpN, epN)"
            raise ConfigError(f"--layouts: {text!r}: part {p!r} is {bad}; {hint}")
        kind, n = m.group(1), int(m.group(2))
        if n < 1:
            raise ConfigError(f"--layouts: {text!r}: {kind} must be >= 1, got {kind}{n}")
        if kind in degrees:
            raise ConfigError(f"--layouts: {text!r} gives {kind} twice; {hint}")
        degrees[kind] = n
    return Layout(name, strategy, degrees.get("dp"), degrees.get("tp", 1), degrees.get("pp", 1), degrees.get("cp", 1),
                  degrees.get("ep", 1))


def parse_layouts(text: str) -> list[Layout]:
    out, seen = [], set()
    for item in split_csv(text, "--layouts"):
        if item.lower() == "single":  # the baseline runs anyway, at P=1
            continue
        lay = parse_layout(item)
        if lay.name not in seen:
            seen.add(lay.name)
            out.append(lay)
    return out


@dataclasses.dataclass
class Job:
    nproc: int
    layout: str
    strategy: str
    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1
    aliases: tuple[str, ...] = ()
    invariant: bool = False  # trained with --layout-invariant

    @property
    def grid(self) -> str:
        return (f"dp{self.dp}×" + (f"cp{self.cp}×" if self.cp > 1 else "") + f"tp{self.tp}×pp{self.pp}"
                + (f"×ep{self.ep}" if self.ep > 1 else ""))

    @property
    def key(self) -> tuple:
        return (self.nproc, self.strategy, self.dp, self.tp, self.pp, self.cp, self.ep, self.invariant)


def plan_jobs(nprocs: list[int], layouts: list[Layout]) -> tuple[list[Job], list[str]]:
    """single at P=1, then every (P, layout) that fits; -> (jobs, notes on what was skipped or merged)."""
    jobs, notes = [Job(1, "single", "single", 1, 1, 1)], []
    for P in nprocs:
        if P == 1:
            notes.append("P=1 runs single only (the baseline)")
            continue
        by_key: dict[tuple, Job] = {}
        for lay in layouts:
            g = lay.grid(P)
            if g is None:
                notes.append(lay.misfit(P))
                continue
            job = Job(P, lay.name, lay.strategy, *g)
            if job.key in by_key:
                first = by_key[job.key]
                first.aliases += (lay.name,)
                notes.append(f"{lay.name} at P={P} is the same job as {first.layout} ({job.grid}): measured once")
                continue
            by_key[job.key] = job
            jobs.append(job)
    return jobs, notes
