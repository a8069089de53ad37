"""Memory kept for backward with and without activation checkpointing, in one process.

``distrain bench activation-memory [--model gpt-small] [--layers 8] [--batch 64]``

Each variant runs in a fresh process (multiprocessing's spawn, so one's peak does not hide the
other's) that first sets glibc's M_MMAP_THRESHOLD to 64 KiB: freed activation buffers then go back to the OS, and
the peak RSS (VmHWM) shows the live peak instead of heap that was freed but kept. Reported:
bytes autograd keeps for backward (counted exactly by a saved-tensor hook), peak RSS above
the model's, and the forward+backward time (median of ``--reps``). Prints a table; ``--json``
writes the rows.
"""

from __future__ import annotations

import json
import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor

from distrain.bench.common import unmap_freed_blocks

MMAP_THRESHOLD = 64 * 1024


def _vm_hwm_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def measure(model: str, layers: int, batch: int, checkpointing: bool, reps: int) -> dict:
    """One variant in this process: saved bytes, peak RSS above the built model, step times."""
    import torch

    from distrain.models import build_model, lm_loss
    from distrain.models.activation_checkpointing import checkpoint_blocks

    torch.manual_seed(0)
    net = build_model(model, n_layer=layers)
    if checkpointing:
        checkpoint_blocks(net)
    x = torch.randint(0, net.config.vocab_size, (batch, net.config.block_size))
    base = _vm_hwm_mib()
    saved, times = 0, []
    for rep in range(reps):
        count = rep == 0

        def pack(t, count=count):
            nonlocal saved
            saved += t.numel() * t.element_size() if count else 0
            return t

        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = lm_loss(net(x), x)
        loss.backward()
        times.append(time.perf_counter() - t0)
        net.zero_grad(set_to_none=True)
    return {"checkpointing": checkpointing, "saved_mib": saved / 2**20, "peak_rss_above_model_mib": _vm_hwm_mib() - base,
            "fwd_bwd_s_median": statistics.median(times)}


def _fresh(model: str, layers: int, batch: int, checkpointing: bool, reps: int) -> dict:
    unmap_freed_blocks(MMAP_THRESHOLD, trim=False)  # before any tensor exists
    return measure(model, layers, batch, checkpointing, reps)


def run(model: str = "gpt-small", layers: int = 8, batch: int = 64, reps: int = 3, json_path: str | None = None) -> int:
    """Both variants (off, then on), each in a fresh process; prints the table, writes ``json_path``."""
    rows = []
    for checkpointing in (False, True):
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows.append(pool.submit(_fresh, model, layers, batch, checkpointing, reps).result())
    print(f"{model}, {layers} layers, batch {batch}, fp32, one process")
    print(f"{'checkpointing':>14} {'kept for backward':>18} {'peak RSS above model':>21} {'fwd+bwd (median)':>17}")
    for r in rows:
        print(f"{'on' if r['checkpointing'] else 'off':>14} {r['saved_mib']:>14.1f} MiB {r['peak_rss_above_model_mib']:>17.0f}"
              f" MiB {r['fwd_bwd_s_median']:>15.2f} s")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "layers": layers, "batch": batch, "rows": rows}, f, indent=2)
    return 0
