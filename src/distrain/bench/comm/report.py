"""Conventions and output of ``distrain bench comm``: sizes and bus bandwidth as nccl-tests
defines them (doc/PERFORMANCE.md), the fixed-width and Markdown tables, and the plot.

Pure functions of the records that collectives.py measures; nothing here starts processes.
"""

from __future__ import annotations

from distrain.bench import common
from distrain.comm.api import COLLECTIVES
from distrain.errors import ConfigError

# ---------------------------------------------------------------------------------------
# Size convention and bus-bandwidth factors (nccl-tests doc/PERFORMANCE.md)
# ---------------------------------------------------------------------------------------

def busbw_factor(op: str, P: int) -> float | None:
    """busbw / algbw for ``op`` on P ranks; None for barrier (no bandwidth)."""
    if op == "all_reduce":
        return 2 * (P - 1) / P
    if op in ("all_gather", "reduce_scatter", "scatter", "gather"):
        return (P - 1) / P
    if op in ("broadcast", "reduce"):
        return 1.0
    if op == "barrier":
        return None
    raise ConfigError(f"unknown collective {op!r}; use one of {', '.join(COLLECTIVES)}")


def per_rank_count(op: str, size: int, P: int, elem: int) -> int:
    """n: elements of the call's per-rank tensor for a requested full-buffer size in bytes."""
    if op == "barrier":
        return 0
    if op in ("all_reduce", "broadcast", "reduce"):
        return max(1, size // elem)
    return max(1, size // (P * elem))


def full_size(op: str, n: int, P: int, elem: int) -> int:
    """S in bytes: the full buffer of nccl-tests' convention for per-rank count n."""
    if op == "barrier":
        return 0
    if op in ("all_reduce", "broadcast", "reduce"):
        return n * elem
    return P * n * elem


def bandwidths(op: str, size: int, P: int, seconds: float) -> tuple[float | None, float | None]:
    """(algbw, busbw) in GB/s; (None, None) for barrier."""
    f = busbw_factor(op, P)
    if f is None:
        return None, None
    algbw = common.bandwidth_GBps(size, seconds)
    return algbw, algbw * f


# ---------------------------------------------------------------------------------------
# Output: tables, JSON, plot
# ---------------------------------------------------------------------------------------

def _cases(records: list[dict]) -> list[tuple[int, str]]:
    return common.dedup((r["P"], r["op"]) for r in records)


def _rows(records: list[dict], P: int, op: str, algs: list[str]):
    """(size, count, {algorithm: record}) rows of one (P, op), in size order."""
    by_size: dict[int, dict[str, dict]] = {}
    counts: dict[int, int] = {}
    for r in records:
        if r["P"] == P and r["op"] == op:
            by_size.setdefault(r["size_bytes"], {})[r["algorithm"]] = r
            counts[r["size_bytes"]] = r["count"]
    return [(s, counts[s], by_size[s]) for s in sorted(by_size)]


def ratio(records: list[dict], P: int, op: str, size: int, num: str = "ring", den: str = "native",
          key: str = "busbw_GBps") -> float | None:
    """records' ``key`` of algorithm num over den at (P, op, size); None if either is missing."""
    got = {r["algorithm"]: r[key] for r in records
           if r["P"] == P and r["op"] == op and r["size_bytes"] == size}
    a, b = got.get(num), got.get(den)
    return a / b if a is not None and b else None


def format_tables(records: list[dict], algs: list[str], dtype: str) -> str:
    out = []
    with_ratio = "ring" in algs and "native" in algs
    for P, op in _cases(records):
        rows_in = _rows(records, P, op, algs)
        groups = [("", ["size", "count"])]
        if op == "barrier":
            groups += [(a, ["time(us)"]) for a in algs]
        else:
            groups += [(a, ["time(us)", "algbw", "busbw"]) for a in algs]
            if with_ratio:
                groups.append(("ring/native", ["busbw"]))
        rows = []
        for size, count, recs in rows_in:
            row = [str(size), str(count)]
            for a in algs:
                r = recs.get(a)
                row.append(common.fmt_num(r["time_us"], 1) if r else "-")
                if op != "barrier":
                    row += [common.fmt_num(r["algbw_GBps"], 3) if r else "-", common.fmt_num(r["busbw_GBps"], 3) if r else "-"]
            if op != "barrier" and with_ratio:
                row.append(common.fmt_num(ratio(records, P, op, size)))
            rows.append(row)
        f = busbw_factor(op, P)
        title = (f"{op}  P={P}  {dtype}  time = median over iterations of the slowest rank (us); "
                 + ("barrier: time only" if f is None else f"algbw, busbw in GB/s (1e9 B/s); busbw = algbw * {f:g}"))
        out.append(common.format_table(groups, rows, title))
    return "\n\n".join(out)


def format_markdown(records: list[dict], algs: list[str]) -> str:
    """The tables of format_tables as Markdown (for docs/benchmarks.md)."""
    out = []
    with_ratio = "ring" in algs and "native" in algs
    for P, op in _cases(records):
        headers = ["size", "count"]
        for a in algs:
            headers += [f"{a} us"] if op == "barrier" else [f"{a} us", f"{a} algbw", f"{a} busbw"]
        if op != "barrier" and with_ratio:
            headers.append("ring/native busbw")
        rows = []
        for size, count, recs in _rows(records, P, op, algs):
            row = [common.format_size(size) if size else "-", str(count)]
            for a in algs:
                r = recs.get(a)
                row.append(common.fmt_num(r["time_us"], 0) if r else "-")
                if op != "barrier":
                    row += [common.fmt_num(r["algbw_GBps"], 3) if r else "-",
                            common.fmt_num(r["busbw_GBps"], 3) if r else "-"]
            if op != "barrier" and with_ratio:
                row.append(common.fmt_num(ratio(records, P, op, size)))
            rows.append(row)
        out.append(f"**{op}, P={P}** (time in µs, bandwidths in GB/s)\n\n" + common.markdown_table(headers, rows))
    return "\n\n".join(out)


def plot(records: list[dict], algs: list[str], path: str) -> None:
    plt = common.require_pyplot()
    cases = [(P, op) for P, op in _cases(records) if op != "barrier"]
    if not cases:
        common.progress("--plot: only barrier was measured; nothing to plot")
        return
    Ps = common.dedup(P for P, _ in cases)
    ops = common.dedup(op for _, op in cases)
    fig, axes = plt.subplots(len(Ps), len(ops), figsize=(4.2 * len(ops), 3.4 * len(Ps)), squeeze=False,
                             sharex=True)
    markers = {"native": "o", "star": "s", "ring": "^", "tree": "v"}
    for i, P in enumerate(Ps):
        for j, op in enumerate(ops):
            ax = axes[i][j]
            for a in algs:
                pts = sorted((r["size_bytes"], r["busbw_GBps"]) for r in records
                             if r["P"] == P and r["op"] == op and r["algorithm"] == a and r["busbw_GBps"] is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers.get(a, "."), label=a)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, P={P}", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            if j == 0:
                ax.set_ylabel("busbw (GB/s)")
            if i == len(Ps) - 1:
                ax.set_xlabel("size S (bytes)")
            if (P, op) not in cases:
                ax.set_visible(False)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    plt.close(fig)
