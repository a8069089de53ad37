"""What a run shows and leaves behind: the progress bar, metrics lines, the summary.

``step_record`` makes one metrics.jsonl line per step; ``sum_losses`` turns the pending
steps' losses into the global batch's loss (one small all-reduce of ``loss * weight`` over
the engine's loss group) and ``write_records`` writes them; ``finish`` (rank 0, after training) writes
summary.json (with the device rank 0 ran on and the process group's backend) and loss.png,
generates a text sample when the whole model is on rank 0, and prints the table.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import TrainingError
from distrain.models import generate
from distrain.trainer.config import TrainConfig
from distrain.trainer.metrics import MetricsLog, format_table, plot_losses, read_metrics


def step_record(step: int, loss: torch.Tensor | None, dt: float, comm_wait: float | None, unit: str,
                units_per_step: int, lr: float) -> dict:
    """One metrics.jsonl line; ``loss`` stays a tensor until ``sum_losses`` sums it over ranks
    (None on ranks that compute no loss, which then contribute 0). ``time``: Unix seconds at
    the end of the step (for tools that plot against wall-clock time)."""
    return {"step": step, "loss": (loss.detach() if loss is not None else torch.zeros(())).double(),
            "time_s": dt, "comm_wait_s": comm_wait, f"{unit}_per_s": units_per_step / dt, "lr": lr,
            "time": time.time()}


class PlainLines:
    """The progress bar's stand-in where no terminal shows one (``--no-progress``, or output to a file or a
    pipe): one plain line per write point (every ``--log-every`` steps, and before an evaluation or a
    checkpoint) and the validation lines, on stdout, flushed. Steps are numbered from 0, as in metrics.jsonl."""

    def __init__(self, cfg: TrainConfig, start: int, label: str):
        self.name, self.total, self.done, self.post = f"{label}/{cfg.model}", cfg.steps, start, {}

    def write(self, line: str) -> None:
        print(line, flush=True)

    def set_postfix(self, post: dict) -> None:
        self.post = post

    def update(self, n: int) -> None:
        self.done += n
        shown = ", ".join(f"{k} {v}" for k, v in self.post.items())
        self.write(f"{self.name} step {self.done - 1}: {shown} ({self.done}/{self.total} steps done)")

    def close(self) -> None:
        pass


def progress_bar(cfg: TrainConfig, start: int, label: str, on: bool):
    """Rank 0's progress display: a tqdm bar when ``--progress`` and stdout and stderr are terminals, else
    :class:`PlainLines` (none with ``--no-progress --no-report``: a quiet run, as the benchmarks start)."""
    if not on or not (cfg.progress or cfg.report):
        return None
    if not (cfg.progress and sys.stdout.isatty() and sys.stderr.isatty()):
        return PlainLines(cfg, start, label)
    from tqdm.auto import tqdm

    # one process writes the bar; tqdm's default lock includes a multiprocessing one (a named semaphore in
    # /dev/shm), which a rank killed with SIGKILL never unlinks ("leaked semaphore objects" at the job's end)
    tqdm.set_lock(threading.RLock())
    return tqdm(total=cfg.steps, initial=start, desc=f"{label}/{cfg.model}", dynamic_ncols=True)


def sum_losses(pending: list[dict], group, weight: float) -> None:
    """Collective over ``group``: each pending loss still a tensor (this rank's part) becomes the sum of
    loss * weight (the global batch's mean loss; a loss the guard summed already is a float and stays);
    a TrainingError on every rank if one is not finite."""
    todo = [r for r in pending if torch.is_tensor(r["loss"])]
    if todo:
        losses = torch.stack([r["loss"] for r in todo]).mul_(weight)
        comm.all_reduce(losses, op="sum", group=group, algorithm="native")
        for r, v in zip(todo, losses.tolist()):
            r["loss"] = v
    bad = next((r for r in pending if not math.isfinite(r["loss"])), None)
    if bad is not None:  # every rank sees the same summed losses, so every rank stops here
        raise TrainingError(f"step {bad['step']}: the loss is {bad['loss']}; the run stops before writing it or a "
                            f"checkpoint (the last good checkpoint stays in --out): lower --lr, use --dtype float64, "
                            f"or check the data")


def add_eval(rec: dict, val: dict | None, log: MetricsLog | None, bar) -> None:
    """Put a validation result into the step record ``rec``; with ``log``, ``rec`` is already written (the
    final step's evaluation runs after the last checkpoint), so its line is rewritten and the bar told."""
    if val is None:
        return
    rec.update(val)
    if log is not None:
        log.rewrite_last(**val)
        if log.tensorboard is not None:
            log.tensorboard.write([{"step": rec["step"], **val}])
    if log is not None and bar is not None and "val_loss" in val:
        bar.write(f"step {rec['step']}: validation loss {val['val_loss']:.4f}")


def write_records(pending: list[dict], log: MetricsLog | None, bar) -> None:
    """Log the summed step records and update the progress bar (rank 0; no-ops elsewhere)."""
    if log is not None:
        log.write(pending)
    if bar is not None:
        r = pending[-1]
        rate_key = next(k for k in r if k.endswith("_per_s"))
        post = {"loss": f"{r['loss']:.4f}", rate_key.replace("_per_s", "/s"): f"{r[rate_key]:,.0f}"}
        if r.get("comm_wait_s") is not None:
            post["comm"] = f"{100 * r['comm_wait_s'] / r['time_s']:.0f}%"
        if "val_loss" in r:
            bar.write(f"step {r['step']}: validation loss {r['val_loss']:.4f}")
        bar.set_postfix(post)
        bar.update(len(pending))


def rank_traffic(led: comm.Ledger, steps: int) -> list[dict]:
    """Every rank's bytes sent and received per step (from its ledger), gathered on all ranks."""
    t = led.total()
    mine = torch.tensor([t.bytes_sent / max(1, steps), t.bytes_recv / max(1, steps)], dtype=torch.float64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    with comm.transport_errors("the traffic report's all_gather"):  # (a peer lost: PeerLostError, secondary)
        dist.all_gather(rows, mine)
    return [{"rank": r, "sent": row[0].item(), "recv": row[1].item()} for r, row in enumerate(rows)]


def summarize(cfg: TrainConfig, label: str, unit: str, units_per_sample: int, out: Path, wall: float, start: int,
              traffic: list[dict], extra: dict) -> dict:
    rows = read_metrics(out / "metrics.jsonl")
    run = [r for r in rows if r["step"] >= start]
    steady = run[min(len(run) - 1, 5):]  # skip warm-up steps for rates
    rate = cfg.batch_size * units_per_sample * len(steady) / max(1e-9, sum(r["time_s"] for r in steady))
    waits = [r["comm_wait_s"] for r in steady if r.get("comm_wait_s") is not None]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return {
        "strategy": cfg.strategy, "label": label, "model": cfg.model, "data": cfg.data, "nproc": cfg.nproc,
        "algorithm": cfg.algorithm if cfg.strategy == "ddp" else None, "steps": cfg.steps,
        "first_loss": rows[0]["loss"], "final_loss": rows[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
        "final_val_accuracy": next((r["val_accuracy"] for r in reversed(rows) if "val_accuracy" in r), None),
        f"{unit}_per_s": rate, "comm_share": sum(waits) / sum(r["time_s"] for r in steady) if waits else None,
        "bytes_per_step": traffic, "bytes_sent_per_step_rank0": traffic[0]["sent"], "wall_s": wall, **extra,
    }


def device_name(device: torch.device) -> str:
    """"cpu", or "cuda:0 (NVIDIA H100 80GB HBM3)": the device and, for a GPU, its model."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def text_sample(model, cfg: TrainConfig, tokenizer) -> str:
    """``cfg.sample_chars`` tokens (bytes, for byte-level data) generated after a newline, decoded
    with the data's own tokenizer (a BPE run's ids are not bytes)."""
    prompt = torch.tensor([tokenizer.encode("\n")], device=next(model.parameters()).device)
    g = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
    ids = generate(model, prompt, cfg.sample_chars, temperature=0.8, top_k=40, generator=g)
    return tokenizer.decode(ids[0].cpu().tolist())


def table_rows(cfg: TrainConfig, s: dict, start: int, unit: str, extra_rows: list) -> list[tuple[str, str]]:
    traffic, share = s["bytes_per_step"], s["comm_share"]
    procs = str(cfg.nproc)
    if s.get("world_final") is not None:  # elastic: the world at the start and at the end
        procs = (f"{s['world_start']} at the start, {s['world_final']} at the end ({s['membership_changes']} "
                 f"membership change{'s' if s['membership_changes'] != 1 else ''})")
    rows = [("strategy", s["label"]), ("model / data", f"{cfg.model} / {cfg.data}"), ("processes", procs),
            ("device / backend", f"{s.get('device')} / {s.get('backend')}"),
            ("steps", f"{start} -> {cfg.steps}"), ("loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}")]
    if s["final_val_loss"] is not None:
        rows.append(("validation loss", f"{s['final_val_loss']:.4f}"))
    if s["final_val_accuracy"] is not None:
        rows.append(("validation accuracy", f"{100 * s['final_val_accuracy']:.1f}%"))
    rows += [(f"{unit} per s", f"{s[f'{unit}_per_s']:,.0f}"),
             ("communication wait", f"{100 * share:.1f}% of step" if share is not None
              else f"not measured by {s['label']}"),
             ("bytes sent per step (rank 0)", f"{traffic[0]['sent']:,.0f}")]
    if len(traffic) > 1:
        rows.append(("bytes per step, busiest rank", f"{max(t['sent'] for t in traffic):,.0f} sent, "
                                                     f"{max(t['recv'] for t in traffic):,.0f} received"))
    return rows + extra_rows + [("wall time", f"{s['wall_s']:.1f} s"),
                                ("outputs", f"{cfg.out}/metrics.jsonl, loss.png, summary.json, checkpoint.json")]


def finish(cfg: TrainConfig, engine, task, out: Path, wall: float, start: int, traffic: list[dict],
           extra: dict) -> dict:
    """Rank 0: summary.json, loss.png, a text sample if possible, and the printed table."""
    summary = summarize(cfg, engine.label, task.unit, task.units_per_sample, out, wall, start, traffic, extra)
    summary["device"] = device_name(getattr(engine, "device", None) or torch.device("cpu"))  # rank 0's
    summary["backend"] = dist.get_backend() if dist.is_initialized() else None
    plot_losses(out / "metrics.jsonl", out / "loss.png", f"{cfg.model} on {cfg.data}, {engine.label}, "
                                                         f"{cfg.nproc} proc")
    model = engine.sample_model()
    if task.unit == "tokens" and cfg.sample_chars > 0 and model is not None:
        summary["sample"] = text_sample(model, cfg, task.tokenizer)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    if cfg.report:
        print("\n" + format_table(table_rows(cfg, summary, start, task.unit, engine.report_rows(summary))))
        if "sample" in summary:
            print("\n--- sample ---\n" + summary["sample"] + "\n--------------")
    return summary
