"""The one table ``distrain plan`` prints, whichever planner filled it.

Both planners (the α-β one on emulated nodes, :mod:`distrain.costmodel.plan`, and the GPU-cluster
one, :mod:`distrain.costmodel.layouts`) print the same columns in the same order (:data:`COLUMNS`);
a quantity a planner does not predict is ``-``. Each column is as wide as its header or its widest
cell, columns are two spaces apart and no cell holds two spaces in a row, so every line of a table
has the header's column count (``re.split(r"\\s{2,}", line.strip())``) and its cells end where the
header's do, however long a layout's name or large a number.
"""

from __future__ import annotations

from dataclasses import dataclass

COLUMNS = ("rank", "layout", "step ms", "compute ms", "comm ms", "tok/s/dev", "MFU %", "busiest link", "mem MB",
           "link MB")
LEFT = {"layout", "busiest link"}  # the names; numbers are right-aligned
GAP = "  "


@dataclass(frozen=True)
class Row:
    """One layout's predicted numbers; None: not predicted by this planner (printed ``-``)."""
    layout: str
    step_s: float
    compute_s: float | None
    comm_s: float | None  # communication time (see docs/cost_model.md for what each planner counts)
    tokens_per_s: float | None  # per rank / device
    mfu: float | None  # fraction of the device's bf16 peak
    busiest_link: str | None  # which link carries the most bytes
    mem_bytes: float  # per rank / device
    link_bytes: float  # per rank / device and step, on its busiest link


def _cells(rank: str, r: Row) -> tuple[str, ...]:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.2f}"  # noqa: E731
    return (rank, r.layout, ms(r.step_s), ms(r.compute_s), ms(r.comm_s),
            "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}",
            "-" if r.mfu is None else f"{100 * r.mfu:.1f}", r.busiest_link or "-",
            f"{r.mem_bytes / 1e6:.1f}", f"{r.link_bytes / 1e6:.1f}")


def format_table(ranked: list[Row], unranked: list[Row] = (), between: str | None = None) -> str:
    """The header, ``ranked`` numbered from 1, then the line ``between`` (if given) and ``unranked`` with
    ``-`` for a rank (the layouts that do not fit), all aligned as one table."""
    body = [_cells(str(i), r) for i, r in enumerate(ranked, 1)]
    rest = [_cells("-", r) for r in unranked]
    widths = [max(len(h), *(len(c[k]) for c in body + rest)) for k, h in enumerate(COLUMNS)]

    def line(cells) -> str:
        return GAP.join(c.ljust(w) if h in LEFT else c.rjust(w) for c, w, h in zip(cells, widths, COLUMNS)).rstrip()

    lines = [line(COLUMNS)] + [line(c) for c in body]
    if between is not None:
        lines.append(between)
    return "\n".join(lines + [line(c) for c in rest])
