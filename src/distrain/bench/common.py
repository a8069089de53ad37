"""Helpers shared by the benchmarks: sizes, timing statistics, metadata, JSON, tables, plots.

Nothing here starts processes or touches torch.distributed, so every function can be
tested (and reused by other benchmarks, e.g. a training-step benchmark) in isolation.

Conventions used by every distrain benchmark:

* sizes are bytes; ``K``/``M``/``G`` suffixes are powers of 1024 (``4K`` = 4096 bytes);
* bandwidths are reported in GB/s with 1 GB = 1e9 bytes (as nccl-tests does);
* a distributed timing is the *slowest rank's* time of one iteration (max over ranks),
  summarised over iterations by the *median* (robust to the odd slow iteration).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
import re
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from distrain.errors import ConfigError, DistrainError

GB = 1e9  # bandwidth unit: bytes per second / GB = GB/s
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMG]?)(?:I?B)?\s*$", re.IGNORECASE)


# ---------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------

def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"64M"`` -> 67108864, ``"1G"``, ``"4096"``; also ``4KB``/``4KiB``.

    Suffixes are powers of 1024. Raises ConfigError on anything else (or on zero).
    """
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ConfigError(
            f"bad size {text!r}: use a positive integer number of bytes with an optional K, M or G "
            f"suffix (powers of 1024), e.g. 4K, 256K, 4M, 64M"
        )
    value = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if value <= 0:
        raise ConfigError(f"bad size {text!r}: sizes must be positive")
    return value


def parse_sizes(text: str) -> list[int]:
    """A comma-separated list of sizes (see :func:`parse_size`), order kept, duplicates dropped."""
    return dedup(parse_size(s) for s in split_csv(text, "--sizes"))


def format_size(nbytes: int) -> str:
    """The inverse of parse_size for exact multiples: 4096 -> ``4K``; else plain bytes."""
    for suffix in ("G", "M", "K"):
        unit = _UNITS[suffix]
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def split_csv(text: str, flag: str) -> list[str]:
    """``"a, b,c"`` -> ``["a", "b", "c"]``; an empty list raises ConfigError naming the flag."""
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise ConfigError(f"{flag}: give at least one value (a comma-separated list), got {text!r}")
    return items


def parse_choices(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """A comma-separated list whose items must all be in ``allowed`` (``all`` = every one)."""
    items = split_csv(text, flag)
    if items == ["all"]:
        return list(allowed)
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ConfigError(f"{flag}: unknown value(s) {', '.join(map(repr, bad))}; choose from "
                          f"{', '.join(allowed)} (comma-separated) or 'all'")
    return dedup(items)


def parse_int(text, flag: str, minimum: int) -> int:
    """One integer >= ``minimum`` (a flag's value), else a one-line ConfigError naming ``flag``."""
    try:
        v = int(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag}: expected an integer, got {text!r}") from None
    if v < minimum:
        raise ConfigError(f"{flag}: must be >= {minimum}, got {v}")
    return v


def parse_ints(text: str, flag: str, minimum: int = 1) -> list[int]:
    """``"2,4"`` -> ``[2, 4]``; every value must be an integer >= minimum."""
    out = []
    for s in split_csv(text, flag):
        try:
            v = int(s)
        except ValueError:
            raise ConfigError(f"{flag}: {s!r} is not an integer (expected e.g. 4 or 2,4)") from None
        if v < minimum:
            raise ConfigError(f"{flag}: values must be >= {minimum}, got {v}")
        out.append(v)
    return dedup(out)


def dedup(items: Iterable) -> list:
    """The items in first-seen order, each once (they must be hashable)."""
    seen, out = set(), []
    for x in items:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


# ---------------------------------------------------------------------------------------
# Timing statistics
# ---------------------------------------------------------------------------------------

def time_call(fn: Callable[[], Any]) -> float:
    """Seconds one blocking call of ``fn`` takes (time.perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(xs: Sequence[float]) -> float:
    """The median (mean of the two middle values for an even count)."""
    s = sorted(float(x) for x in xs)
    if not s:
        raise ValueError("median of an empty sequence")
    k = len(s) // 2
    return s[k] if len(s) % 2 else (s[k - 1] + s[k]) / 2


def slowest_rank_times(times: Sequence[Sequence[float]]) -> list[float]:
    """Per iteration, the slowest rank's time: ``times[rank][iteration]`` -> max over ranks."""
    rows = [list(map(float, r)) for r in times]
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise ValueError("times must be a non-empty [ranks][iterations] table with equal-length rows")
    return [max(col) for col in zip(*rows)]


def median_of_max(times: Sequence[Sequence[float]]) -> float:
    """The benchmark statistic: max over ranks per iteration, then median over iterations."""
    return median(slowest_rank_times(times))


def adaptive_iters(seconds_per_iter: float, target_s: float = 0.5, lo: int = 5, hi: int = 50) -> int:
    """Iterations so that one cell takes about ``target_s``: ceil(target/t), clamped to [lo, hi]."""
    if math.isnan(seconds_per_iter) or math.isinf(seconds_per_iter):
        return lo
    if seconds_per_iter <= 0:
        return hi
    return int(min(hi, max(lo, math.ceil(target_s / seconds_per_iter))))


def bandwidth_GBps(nbytes: int, seconds: float) -> float:
    """Bytes over seconds in GB/s (1e9 bytes/s)."""
    return nbytes / seconds / GB if seconds > 0 else float("nan")


def unmap_freed_blocks(threshold: int = 64 << 10, trim: bool = True):
    """glibc from now on unmaps every freed block above ``threshold`` bytes (mallopt M_MMAP_THRESHOLD)
    and, with ``trim``, returns the heap it keeps now (malloc_trim), so the RSS high-water mark follows
    the live tensors rather than freed heap. Returns libc (for a later ``malloc_trim(0)``)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, threshold)  # M_MMAP_THRESHOLD
    if trim:
        libc.malloc_trim(0)
    return libc


def memcpy_GBps(nbytes: int = 64 << 20, reps: int = 10) -> float:
    """This machine's memory copy rate now, in GB/s: the median of ``reps`` copies of ``nbytes``
    on one thread (torch's copy_). Printed beside bandwidths so that results taken on machines
    of different memory speed (or in another memory state of one VM) can be read side by side."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # touch every page once
        return bandwidth_GBps(nbytes, median([time_call(lambda: dst.copy_(src)) for _ in range(reps)]))
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------
# Metadata and JSON
# ---------------------------------------------------------------------------------------

def metadata(command: str | None = None, **extra: Any) -> dict[str, Any]:
    """What a result file should say about where and how it was measured.

    ``command`` is the benchmark's command line (default: this process's sys.argv).
    """
    import torch

    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "command": command if command is not None else " ".join(sys.argv),
        "argv": list(sys.argv),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    meta.update(extra)
    return meta


def write_json(path: str, meta: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Write ``{"meta": meta, "records": records}`` (floats kept exact; NaN/inf -> null)."""
    def clean(x):
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(clean({"meta": meta, "records": records}), f, indent=1)
        f.write("\n")


# ---------------------------------------------------------------------------------------
# Text tables
# ---------------------------------------------------------------------------------------

def fmt_num(x: float | None, digits: int = 2) -> str:
    """Fixed-point with ``digits`` decimals; '-' for missing values."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def format_table(groups: Sequence[tuple[str, Sequence[str]]], rows: Sequence[Sequence[str]],
                 title: str | None = None) -> str:
    """An nccl-tests-like fixed-width table with grouped column headers.

    ``groups`` is ``[(group label, [column headers...]), ...]``; each row has one string per
    column overall. Columns are right-aligned; group labels are centred over their columns.
    """
    headers = [h for _, hs in groups for h in hs]
    if any(len(r) != len(headers) for r in rows):
        raise ValueError("every row needs one cell per column")
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    sep = "  "
    top, col = [], 0
    for label, hs in groups:
        w = sum(widths[col:col + len(hs)]) + len(sep) * (len(hs) - 1)
        top.append(label.center(w) if label else " " * w)
        col += len(hs)
    lines = []
    if title:
        lines.append(f"# {title}")
    lines.append("# " + sep.join(top).rstrip())
    lines.append("# " + sep.join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in rows:
        lines.append("  " + sep.join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same data as a GitHub-flavoured Markdown table (numbers right-aligned)."""
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


# ---------------------------------------------------------------------------------------
# Plotting
# ---------------------------------------------------------------------------------------

def require_pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend, or a clear error if it is missing."""
    try:
        import matplotlib
    except ImportError as e:
        raise DistrainError(
            "--plot needs matplotlib, which is not installed in this environment: "
            "`pip install matplotlib` (it is a dependency of distrain; reinstall with `pip install -e .`)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def progress(msg: str) -> None:
    """One progress line on stderr (flushed: ranks are separate processes)."""
    print(msg, file=sys.stderr, flush=True)
