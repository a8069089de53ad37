"""Published training runs against the planner: the rows, the errors, and the summary.

A validation file (TOML, read with ``tomllib``) holds ``[[run]]`` tables, each with

* ``source``: title, table or figure (and commit) of the publication;
* ``config``: the configuration as published; ``assumed``: what the source leaves out and the
  row assumes (optional);
* ``metric`` (:data:`~distrain.costmodel.step.METRICS`) and ``published``, the published figure;
* ``command``: the ``distrain plan`` command that predicts it (one layout, every field given).

``distrain plan --validate FILE`` parses each command with ``distrain plan``'s own parser,
predicts it (:meth:`~distrain.costmodel.step.Case.predict`, sustained and nominal efficiencies)
and prints published, predicted and error = (predicted - published) / published. The summary
gives the median and largest absolute error and, per source, whether the predictions order
the source's configurations as the published figures do (pairs in the same order / all pairs,
Kendall's tau).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from distrain.costmodel.step import METRICS
from distrain.errors import ConfigError

REQUIRED = ("source", "config", "metric", "published", "command")


@dataclass
class Row:
    source: str
    config: str
    metric: str
    published: float
    command: str
    assumed: str = ""
    predicted: float = float("nan")
    nominal: float = float("nan")  # with the published kernel efficiencies, before calibration

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published

    @property
    def nominal_error(self) -> float:
        return (self.nominal - self.published) / self.published

    @property
    def short_source(self) -> str:
        return self.source.split(",")[0]


def load(path: str) -> list[Row]:
    """The ``[[run]]`` rows of ``path``; a one-line ConfigError naming the row and key that is wrong."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError("--validate needs Python >= 3.11 (tomllib)") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"--validate {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--validate {path}: not valid TOML ({e})") from None
    runs = data.get("run")
    if not isinstance(runs, list) or not runs:
        raise ConfigError(f"--validate {path}: no [[run]] tables; each needs {', '.join(REQUIRED)}")
    rows = []
    for i, r in enumerate(runs, 1):
        missing = [k for k in REQUIRED if k not in r]
        if missing:
            raise ConfigError(f"--validate {path}: run {i} lacks {', '.join(missing)}")
        if r["metric"] not in METRICS:
            raise ConfigError(f"--validate {path}: run {i} has metric {r['metric']!r}; use one of {', '.join(METRICS)}")
        if not isinstance(r["published"], (int, float)) or r["published"] <= 0:
            raise ConfigError(f"--validate {path}: run {i}'s published figure must be a positive number")
        if not str(r["command"]).startswith("distrain plan "):
            raise ConfigError(f"--validate {path}: run {i}'s command must start with 'distrain plan '")
        rows.append(Row(str(r["source"]), str(r["config"]), r["metric"], float(r["published"]), str(r["command"]),
                        str(r.get("assumed", ""))))
    return rows


def kendall(pub: list[float], pred: list[float]) -> tuple[int, int]:
    """(pairs ordered alike by both, all pairs with distinct published values)."""
    same = total = 0
    for i in range(len(pub)):
        for j in range(i + 1, len(pub)):
            if pub[i] == pub[j]:
                continue
            total += 1
            same += (pub[i] - pub[j]) * (pred[i] - pred[j]) > 0
    return same, total


def summary(rows: list[Row]) -> dict:
    errs = [abs(r.error) for r in rows]
    by_source: dict[str, list[Row]] = {}
    for r in rows:
        by_source.setdefault(r.short_source, []).append(r)
    ranking = {}
    for src, rs in by_source.items():
        same, total = kendall([r.published for r in rs], [r.predicted for r in rs])
        ranking[src] = dict(rows=len(rs), pairs_in_order=same, pairs=total,
                            tau=(2 * same - total) / total if total else 1.0,
                            median_abs_error=statistics.median(abs(r.error) for r in rs))
    return dict(rows=len(rows), sources=len(by_source), median_abs_error=statistics.median(errs),
                max_abs_error=max(errs), nominal_median_abs_error=statistics.median(abs(r.nominal_error) for r in rows),
                ranking=ranking)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v < 10 else f"{v:,.0f}" if v >= 1000 else f"{v:.1f}"


def table(rows: list[Row], markdown: bool = False) -> str:
    """Published, predicted (sustained), error, and the nominal prediction's error, per row."""
    head = ["source", "configuration", "metric", "published", "predicted", "error", "nominal error"]
    body = [[r.short_source, r.config, r.metric, _fmt(r.published), _fmt(r.predicted), f"{100 * r.error:+.1f}%",
             f"{100 * r.nominal_error:+.1f}%"] for r in rows]
    if markdown:
        return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] +
                         ["| " + " | ".join(b) + " |" for b in body])
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    return "\n".join("  ".join(x[i].ljust(widths[i]) if i < 3 else x[i].rjust(widths[i]) for i in range(len(head)))
                     for x in [head] + body)


def format_summary(s: dict) -> str:
    lines = [f"{s['rows']} runs from {s['sources']} sources: median |error| {100 * s['median_abs_error']:.1f} %, "
             f"max {100 * s['max_abs_error']:.1f} % (nominal kernel efficiencies: median "
             f"{100 * s['nominal_median_abs_error']:.1f} %)"]
    for src, r in s["ranking"].items():
        lines.append(f"  {src}: {r['rows']} runs, median |error| {100 * r['median_abs_error']:.1f} %, ranking: "
                     f"{r['pairs_in_order']} of {r['pairs']} pairs in the published order (Kendall tau {r['tau']:.2f})")
    return "\n".join(lines)
