"""Run records: metrics.jsonl (one JSON object per step), the loss-curve PNG, the summary table."""

from __future__ import annotations

import json
import os
from pathlib import Path


class MetricsLog:
    """Append-only JSON lines, one object per step with at least ``step`` and ``loss``.

    On resume, lines for steps >= the resumed step (written after the checkpoint by a run
    that then died) are dropped, so the file reads as one uninterrupted run.
    """

    def __init__(self, path: str | os.PathLike, start_step: int = 0, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if start_step > 0 and self.path.exists():
            kept = [ln for ln in self.path.read_text().splitlines() if _step(ln) < start_step]
        self.path.write_text("".join(ln + "\n" for ln in kept))
        self.tensorboard = TensorBoardLog(self.path.parent) if tensorboard else None
        # the membership changes on file, by epoch: every rank of an elastic job learns of each change, so a
        # new rank 0 holds changes its predecessor wrote; each is written once
        self.epochs = {r["epoch"] for ln in kept if (r := _record(ln)) is not None and _membership(r)}

    def write(self, records: list[dict]) -> None:
        records = [r for r in records if not (_membership(r) and r["epoch"] in self.epochs)]
        self.epochs |= {r["epoch"] for r in records if _membership(r)}
        with self.path.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        if self.tensorboard is not None:
            self.tensorboard.write(records)

    def rewind(self, step: int) -> set[int]:
        """Drop the step lines from ``step`` on (an elastic job rolled them back) and a torn line (a rank 0
        killed while writing it: the next rank 0 writes that step again), keep every event line; returns the
        steps of the step lines kept."""
        rows = [ln for ln in self.path.read_text().splitlines() if ln.strip()] if self.path.exists() else []
        kept = [(ln, r) for ln in rows if (r := _record(ln)) is not None and ("event" in r or r["step"] < step)]
        self.path.write_text("".join(ln + "\n" for ln, _ in kept))
        self.epochs = {r["epoch"] for _, r in kept if _membership(r)}
        return {r["step"] for _, r in kept if "event" not in r}

    def rewrite_last(self, **fields) -> None:
        """Add fields to the last record (e.g. a validation loss computed after it was written)."""
        lines = self.path.read_text().splitlines()
        rec = json.loads(lines[-1])
        rec.update(fields)
        lines[-1] = json.dumps(rec)
        self.path.write_text("".join(ln + "\n" for ln in lines))


def _membership(r: dict) -> bool:
    """An elastic job's membership line (one per change, numbered by its epoch)."""
    return r.get("event") == "membership" and isinstance(r.get("epoch"), int)


def _record(line: str) -> dict | None:
    """A line's record, or None for a torn line."""
    try:
        r = json.loads(line)
    except ValueError:
        return None
    return r if isinstance(r, dict) and ("event" in r or isinstance(r.get("step"), int)) else None


def _step(line: str) -> float:
    """A line's step; a blank or torn line (a run killed mid-write) counts as past any resume point."""
    try:
        return json.loads(line).get("step", float("inf"))
    except ValueError:
        return float("inf")


class TensorBoardLog:
    """The same records as TensorBoard scalars in ``<out>/tensorboard`` (every numeric field but
    ``step``, at x = step), when the optional ``tensorboard`` package is installed; else nothing."""

    def __init__(self, out: str | os.PathLike):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is an optional extra: pip install 'distrain[tensorboard]'
            self.writer = None
            return
        self.writer = SummaryWriter(log_dir=str(Path(out) / "tensorboard"))

    def write(self, records: list[dict]) -> None:
        if self.writer is None:
            return
        for r in records:
            for k, v in r.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    self.writer.add_scalar(k, v, r["step"], walltime=r.get("time"))
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def has_step_lines(path: str | os.PathLike) -> bool:
    """``path`` (a metrics.jsonl) exists and holds a whole step line (torn lines and event lines do not count)."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines() if Path(path).is_file() else []
    except OSError:
        return False
    return any((r := _record(ln)) is not None and "event" not in r for ln in lines)


def read_events(path: str | os.PathLike) -> list[dict]:
    """The event lines of a metrics.jsonl (an elastic job's membership changes and stop)."""
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    return [r for r in rows if "event" in r]


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The step lines (an elastic job's membership lines, those with "event", are left out)."""
    rows = [json.loads(ln) for ln in Path(path).read_text().splitlines() if ln.strip()]
    return [r for r in rows if "event" not in r]


def plot_losses(metrics_path: str | os.PathLike, png_path: str | os.PathLike, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], lw=1, label="train loss")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    return Path(png_path)


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)
