"""``distrain bench zero``: memory per rank and step time of DDP and ZeRO, ours and torch's, in one run.

    distrain bench zero --nproc 2 --strategies all --model gpt-small --n-embd 256 --n-layer 8 --json F

Strategies (same model, same seed, same global batch, AdamW, ``--steps`` after ``--warmup``):

* ``ddp``: our DistributedDataParallel;  ``zero1``/``zero2``/``zero3``: our ``Zero`` engine;
* ``torch-ddp``: torch.nn.parallel.DistributedDataParallel;
* ``torch-zero1``: torch DDP + torch.distributed.optim.ZeroRedundancyOptimizer (ZeRO-1);
* ``torch-fsdp``: FSDP2, ``torch.distributed.fsdp.fully_shard`` on every layer and the root (ZeRO-3).

Each (P, strategy) is a fresh set of processes, so memory peaks do not mix. Measured per rank
(max over ranks reported): the bytes of the distinct storages holding parameters, gradients
and optimizer state after the last step (before zero_grad), our DDP's gradient buckets, and
the peak resident set size of one more step, after the timed ones, above the RSS before the
model was built (Linux VmHWM, reset through /proc/self/clear_refs; for that step glibc unmaps
every freed block above 128 KiB, so the peak follows live tensors rather than what the
allocator keeps; it still includes one-time library state, alike for every strategy). Beside them: the formulas of memory.py for
Psi = the model's parameter count (ours: fp32, no master copy; the paper's: mixed precision).
Step time is rank 0's median after warm-up; ``--rounds`` repeats all jobs in rotated order
and reports medians over rounds, so a loaded machine's noise hits every strategy alike. The
command line (distrain/cli/bench.py) parses the flags into :class:`Settings`, which :func:`run` takes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from distrain.bench.common import format_table, metadata, progress, unmap_freed_blocks, write_json
from distrain.errors import ConfigError

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "torch-ddp", "torch-zero1", "torch-fsdp")
STAGE_OF = {"ddp": 0, "torch-ddp": 0, "zero1": 1, "torch-zero1": 1, "zero2": 2, "zero3": 3, "torch-fsdp": 3}


@dataclass(frozen=True)
class Settings:
    """One ``bench zero`` run, its flags parsed and checked (distrain/cli/bench.py)."""
    nprocs: list[int]  # world sizes, each >= 2
    strategies: list[str]  # of STRATEGIES
    model: str  # a GPT preset (gpt-tiny, gpt-small)
    n_embd: int  # GPT width override
    n_layer: int  # GPT depth override
    batch_size: int  # global batch (sequences of block_size tokens)
    steps: int  # timed steps per job
    warmup: int  # untimed steps per job
    algorithm: str  # collective algorithm of ours (native, star, ring, tree)
    bucket_cap_mb: float  # bucket size of DDP, torch DDP, zero1/2
    rounds: int  # repeats of every job, order rotated; medians over rounds
    json_path: str | None = None  # where every record goes


def _wrap(strategy: str, model, opts: Settings):
    """-> (forward, step, tensors) for one strategy; tensors() -> {kind: [tensors]}."""
    import torch
    import torch.nn as nn

    from distrain.parallel.data_parallel import DistributedDataParallel
    from distrain.parallel.zero import Zero
    from distrain.parallel.zero.memory import optimizer_state_tensors

    def adamw(ps):
        return torch.optim.AdamW(ps, lr=1e-3)

    if strategy.startswith("zero"):
        eng = Zero(model, adamw, stage=int(strategy[-1]), algorithm=opts.algorithm, bucket_cap_mb=opts.bucket_cap_mb)
        r = eng.impl.resident
        return eng, eng.step, eng.zero_grad, lambda: dict(r(), optimizer=optimizer_state_tensors(eng.optimizer))
    if strategy == "torch-fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        fwd = model
    elif strategy == "ddp":
        fwd = DistributedDataParallel(model, algorithm=opts.algorithm, bucket_cap_mb=opts.bucket_cap_mb)
    else:
        fwd = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=opts.bucket_cap_mb)
    if strategy == "torch-zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    else:
        opt = adamw(model.parameters())

    def tensors():
        ps = list(model.parameters())
        out = {"params": ps, "grads": [p.grad for p in ps], "optimizer": optimizer_state_tensors(opt)}
        if strategy == "ddp":
            out["buffers"] = [b.buffer for b in fwd.buckets]
        return out

    return fwd, opt.step, lambda: opt.zero_grad(set_to_none=True), tensors


def _job(rank: int, strategy: str, opts: Settings) -> dict:
    import torch
    import torch.distributed as dist

    from distrain import comm
    from distrain.models import build_model, count_parameters, lm_loss
    from distrain.parallel.zero.memory import PeakRSS, resident_bytes, rss_bytes

    P = dist.get_world_size()
    base = rss_bytes()
    torch.manual_seed(0)
    model = build_model(opts.model, n_embd=opts.n_embd, n_layer=opts.n_layer)
    psi = count_parameters(model)
    fwd, step, zero_grad, tensors = _wrap(strategy, model, opts)
    g = torch.Generator().manual_seed(1)
    T = model.layers[0].block_size
    rows = slice(rank * opts.batch_size // P, (rank + 1) * opts.batch_size // P)

    def one_step(measure: bool = False) -> tuple[float, dict]:
        idx = torch.randint(0, 256, (opts.batch_size, T + 1), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        lm_loss(fwd(idx[rows, :-1]), idx[rows, 1:]).backward()
        step()
        dt = time.perf_counter() - t0
        held = {k: resident_bytes(v) for k, v in tensors().items()} if measure else {}
        zero_grad()
        return dt, held

    with comm.ledger() as led:
        for _ in range(opts.warmup):
            one_step()
        led.reset()
        timed = [one_step(measure=i == opts.steps - 1) for i in range(opts.steps)]
    # Memory pass: glibc now unmaps every freed block above 128 KiB (M_MMAP_THRESHOLD = -3) and
    # returns what it kept, so the RSS high-water mark follows the live tensors. (Not during the
    # timed steps: fresh mappings fault their pages in again, which slowed sharded runs 2-4x.)
    unmap_freed_blocks(128 * 1024)
    one_step()
    peak = PeakRSS()
    peak.start()
    peak.base = base
    one_step()
    return {"psi": psi, "step_s": statistics.median(t for t, _ in timed), "peak": peak.peak(), **timed[-1][1],
            "sent_per_step": led.bytes_sent() // opts.steps}


def _record(P: int, strategy: str, per_rank: list[dict]) -> dict:
    from distrain.parallel.zero.memory import model_bytes, paper_bytes

    psi, stage = per_rank[0]["psi"], STAGE_OF[strategy]
    want = model_bytes(stage, psi, P)
    rec = {"nproc": P, "strategy": strategy, "stage": stage, "psi": psi, "step_ms": 1e3 * per_rank[0]["step_s"],
           "peak_mem_bytes": max(r["peak"] for r in per_rank), "peak_mem_bytes_per_rank": [r["peak"] for r in per_rank],
           "bytes_sent_per_step": max(r["sent_per_step"] for r in per_rank),
           "formula_bytes": want, "paper_mixed_precision_bytes": paper_bytes(stage, psi, P)["total"]}
    for k in ("params", "grads", "optimizer", "buffers"):
        rec[f"{k}_bytes"] = max(r.get(k, 0) for r in per_rank)
    rec["state_bytes"] = rec["params_bytes"] + rec["grads_bytes"] + rec["optimizer_bytes"]
    return rec


def run(opts: Settings) -> int:
    """Run every job of ``opts`` (in rotated order, ``opts.rounds`` times), print the table, write the JSON."""
    import distrain

    nprocs, strategies = opts.nprocs, opts.strategies
    if not opts.model.startswith("gpt"):
        raise ConfigError(f"--model {opts.model!r}: bench zero runs a GPT preset (gpt-tiny, gpt-small)")
    if opts.steps < 1 or opts.warmup < 1 or opts.rounds < 1:
        raise ConfigError("--steps, --warmup and --rounds must be >= 1")
    for P in nprocs:
        if opts.batch_size % P:
            raise ConfigError(f"--batch-size {opts.batch_size} is not divisible by --nproc {P}")
    jobs = [(P, s) for P in nprocs for s in strategies]
    runs: dict[tuple[int, str], list[dict]] = {}
    for rnd in range(opts.rounds):
        k = rnd % len(jobs)
        for P, s in jobs[k:] + jobs[:k]:
            progress(f"round {rnd + 1}/{opts.rounds}: {s} on {P} processes")
            runs.setdefault((P, s), []).append(_record(P, s, distrain.spawn(_job, P, args=(s, opts), timeout=1200)))
    records = []
    for (P, s), rs in runs.items():
        rec = dict(rs[len(rs) // 2])
        for k in ("step_ms", "peak_mem_bytes"):
            rec[k] = statistics.median(r[k] for r in rs)
        rec["rounds"] = len(rs)
        records.append(rec)
    for r in records:
        peer = next((q for q in records if q["nproc"] == r["nproc"] and q["strategy"] == "torch-fsdp"), None)
        r["step_vs_torch_fsdp"] = peer["step_ms"] / r["step_ms"] if peer else None
        r["peak_vs_torch_fsdp"] = r["peak_mem_bytes"] / peer["peak_mem_bytes"] if peer else None
    print(_table(records, opts))
    if opts.json_path:
        write_json(opts.json_path, metadata(model=opts.model, n_embd=opts.n_embd, n_layer=opts.n_layer,
                                       batch_size=opts.batch_size, steps=opts.steps, warmup=opts.warmup,
                                       rounds=opts.rounds, algorithm=opts.algorithm,
                                       bucket_cap_mb=opts.bucket_cap_mb), records)
    return 0


def _table(records: list[dict], opts: Settings) -> str:
    mb = 1e6
    rows = []
    order = {s: i for i, s in enumerate(STRATEGIES)}
    for r in sorted(records, key=lambda r: (r["nproc"], order[r["strategy"]])):
        f = r["formula_bytes"]
        rows.append([str(r["nproc"]), r["strategy"], f"{r['params_bytes'] / mb:.1f} ({f['params'] / mb:.1f})",
                     f"{r['grads_bytes'] / mb:.1f} ({f['grads'] / mb:.1f})",
                     f"{r['optimizer_bytes'] / mb:.1f} ({f['optimizer'] / mb:.1f})",
                     f"{r['state_bytes'] / mb:.1f} ({f['total'] / mb:.1f})", f"{r['buffers_bytes'] / mb:.1f}",
                     f"{r['peak_mem_bytes'] / mb:.1f}", f"{r['paper_mixed_precision_bytes'] / mb:.1f}",
                     f"{r['step_ms']:.0f}", f"{r['bytes_sent_per_step'] / mb:.2f}" if not r["strategy"].startswith("torch")
                     else "n/a",
                     f"{r['peak_vs_torch_fsdp']:.2f} / {r['step_vs_torch_fsdp']:.2f}" if r["peak_vs_torch_fsdp"] else ""])
    psi = records[0]["psi"]
    head = (f"{opts.model} (n_embd {opts.n_embd}, n_layer {opts.n_layer}), Psi = {psi:,} parameters, AdamW fp32, "
            f"global batch {opts.batch_size}; MB = 1e6 bytes per rank (max over ranks), formula in parentheses")
    return head + "\n" + format_table(
        [("", ["P", "strategy"]), ("held after step: measured (formula)", ["params", "grads", "optim", "total"]),
         ("", ["DDP buckets", "peak RSS", "paper 16Psi-style"]),
         ("", ["step ms", "MB sent/step", "vs FSDP2 peak / speed"])], rows)
