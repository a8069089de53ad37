"""Context parallelism on one long sequence: activation memory, peak memory, time and bytes per rank.

``distrain bench cp-memory [--model gpt-small] [--seq 4096] [--cp 2,4]
[--algorithms ring,all-to-all] [--reps 3] [--json FILE]``

One process (the whole sequence), then every cp size and attention (N ranks, each holding 2
chunks of the sequence), on the same seeded model (its block size set to ``--seq``), fp32, one
sequence per step (``--batch``), forward + backward through ``parallelize`` (the trainer's path;
no optimizer). Per rank:

* activations: the bytes autograd keeps for backward during the step, each storage counted
  once, parameters not counted (saved-tensor hooks, as ``bench tp`` measures them): exact;
* peak: the resident set's high-water mark (VmHWM, reset through /proc/self/clear_refs) during
  a step above the RSS just before it, after a warm-up step (so gradients and communication
  buffers already exist), with glibc told to unmap freed blocks (M_MMAP_THRESHOLD 64 KiB, as
  ``bench layouts`` does) so the peak follows live tensors and temporaries;
* step time: median over ``--reps`` steps after the warm-up (each rank ``--threads`` torch
  threads; 0: ``cpu_count // N``, as ``distrain train``), and over ``--rounds`` repeats of every
  layout in rotated order (the other columns are the same in every round);
* bytes: what the ledger counts under ``cp-ring`` / ``cp-all-to-all`` in one step, next to
  ``ring_bytes`` / ``ulysses_bytes`` times the number of layers.

Prints a table; ``--json`` writes the rows.
"""

from __future__ import annotations

import json
import os
import statistics
import time

from distrain.bench.common import unmap_freed_blocks

MMAP_THRESHOLD = 64 * 1024


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024


def _rank(rank: int, model_name: str, seq: int, batch: int, variant: str, reps: int) -> dict:
    import torch

    from distrain import comm
    from distrain.models import build_model, lm_loss
    from distrain.models.registry import model_cp_plan
    from distrain.parallel import parallelize
    from distrain.parallel.context_parallel import ring_bytes, ulysses_bytes
    from distrain.topology import Topology

    libc = unmap_freed_blocks(MMAP_THRESHOLD, trim=False)  # freed blocks go back to the OS
    N = torch.distributed.get_world_size()
    torch.manual_seed(0)
    model = build_model(model_name, block_size=seq)
    c = model.config
    pm = parallelize(model, Topology.from_world(cp=N), loss_fn=lm_loss, cp_plan=model_cp_plan(model) if N > 1 else None,
                     cp_algorithm=variant if N > 1 else "ring")
    ids = torch.randint(0, c.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(1))
    x, y = ids[:, :-1], ids[:, 1:]
    pm.train_step(x, y)  # warm-up: gradients, buffers and caches exist from here on
    libc.malloc_trim(0)
    params = {p.untyped_storage().data_ptr() for p in pm.module.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    with comm.ledger() as led, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm.train_step(x, y)
    peak = _status("VmHWM") - before
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        pm.train_step(x, y)
        times.append(time.perf_counter() - t0)
    label = "cp-ring" if variant == "ring" else "cp-all-to-all"
    sent = led.get(label, "p2p").bytes_sent
    h, g, d, L = c.n_head, getattr(c, "n_kv_head", c.n_head), c.n_embd // c.n_head, seq // N
    f = ring_bytes(batch, g, L, d, N) if variant == "ring" else ulysses_bytes(batch, h, g, L, d, N)
    return {"rank": rank, "saved_bytes": sum(seen.values()), "peak_bytes": peak, "step_s": statistics.median(times),
            "cp_bytes_sent": sent, "formula_bytes": c.n_layer * (f["forward"] + f["backward"]) if N > 1 else 0}


def measure(model: str, seq: int, batch: int, N: int, variant: str, reps: int, threads: int = 0) -> dict:
    import distrain

    ranks = distrain.spawn(_rank, N, args=(model, seq, batch, variant, reps), timeout=1800,
                           threads_per_rank=threads or None)
    return {"cp": N, "variant": variant if N > 1 else "one process", "ranks": ranks,
            "saved_bytes_max": max(r["saved_bytes"] for r in ranks),
            "peak_bytes_max": max(r["peak_bytes"] for r in ranks),
            "step_s": ranks[0]["step_s"], "cp_bytes_sent_max": max(r["cp_bytes_sent"] for r in ranks),
            "formula_bytes": ranks[0]["formula_bytes"]}


def run(model: str = "gpt-small", seq: int = 4096, batch: int = 1, cps: tuple[int, ...] = (2, 4),
        algorithms: tuple[str, ...] = ("ring", "all-to-all"), reps: int = 3, threads: int = 0, rounds: int = 1,
        json_path: str | None = None) -> int:
    """One process, then every (cp size, attention) pair, ``rounds`` times in rotated order; prints the
    table, writes ``json_path``."""
    layouts = [(1, "ring")] + [(n, v) for n in cps for v in algorithms]
    runs: dict[int, list[dict]] = {}
    for rnd in range(rounds):
        k = rnd % len(layouts)
        for i in list(range(len(layouts)))[k:] + list(range(len(layouts)))[:k]:
            runs.setdefault(i, []).append(measure(model, seq, batch, *layouts[i], reps, threads))
    rows = []
    for i in range(len(layouts)):
        row = dict(runs[i][0])
        row["step_s_rounds"] = [r["step_s"] for r in runs[i]]
        row["step_s"] = statistics.median(row["step_s_rounds"])
        rows.append(row)
    one = rows[0]
    mb = 1e6
    print(f"{model}, {seq} tokens x {batch} sequence(s) per step, fp32, forward + backward, "
          f"{threads or 'cpu_count // N'} torch thread(s) per rank, median step of {rounds} round(s); per rank, "
          f"max over ranks; MB = 1e6 bytes")
    print(f"{'layout':>22} {'activations MB':>15} {'/ one':>6} {'peak MB':>8} {'/ one':>6} {'step ms':>8} "
          f"{'cp MB sent':>11} {'formula MB':>11}")
    for r in rows:
        name = "one process" if r["cp"] == 1 else f"cp{r['cp']} {r['variant']}"
        print(f"{name:>22} {r['saved_bytes_max'] / mb:>15.1f} {r['saved_bytes_max'] / one['saved_bytes_max']:>6.3f} "
              f"{r['peak_bytes_max'] / mb:>8.1f} {r['peak_bytes_max'] / one['peak_bytes_max']:>6.3f} "
              f"{1e3 * r['step_s']:>8.0f} {r['cp_bytes_sent_max'] / mb:>11.3f} {r['formula_bytes'] / mb:>11.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"model": model, "seq": seq, "batch": batch, "threads": threads, "rounds": rounds,
                       "load_avg_end": list(os.getloadavg()), "rows": rows}, f, indent=1)
    return 0
