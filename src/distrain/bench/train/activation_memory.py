"""Memory kept for backward with and without activation checkpointing, in one process.

``python -m distrain.bench.train.activation_memory [--model gpt-small] [--layers 8] [--batch 64]``

Each variant runs in a fresh subprocess (so one's peak does not hide the other's) with
``MALLOC_MMAP_THRESHOLD_=65536``: glibc then returns freed activation buffers to the OS, and
the peak RSS (VmHWM) shows the live peak instead of heap that was freed but kept. Reported:
bytes autograd keeps for backward (counted exactly by a saved-tensor hook), peak RSS above
the model's, and the forward+backward time (median of ``--reps``). Prints a table; ``--json``
writes the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt-small")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="")
    p.add_argument("--one", choices=("on", "off"), help=argparse.SUPPRESS)  # a variant, in its subprocess
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.model, a.layers, a.batch, a.one == "on", a.reps)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    rows = []
    for one in ("off", "on"):
        out = subprocess.run([sys.executable, "-m", "distrain.bench.train.activation_memory", "--one", one,
                              "--model", a.model, "--layers", str(a.layers), "--batch", str(a.batch),
                              "--reps", str(a.reps)], env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{a.model}, {a.layers} layers, batch {a.batch}, fp32, one process")
    print(f"{'checkpointing':>14} {'kept for backward':>18} {'peak RSS above model':>21} {'fwd+bwd (median)':>17}")
    for r in rows:
        print(f"{'on' if r['checkpointing'] else 'off':>14} {r['saved_mib']:>14.1f} MiB {r['peak_rss_above_model_mib']:>17.0f}"
              f" MiB {r['fwd_bwd_s_median']:>15.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "layers": a.layers, "batch": a.batch, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
