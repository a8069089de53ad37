"""``distrain selftest``: every way of training against one process, on whatever this machine has.

:func:`run` trains ``llama-small`` (4 blocks, grouped-query attention; models/registry.py) for a
few AdamW steps in fp64 with every strategy and layout (:data:`CHECKS`: our DDP, torch's DDP,
ZeRO 1-3, tp 2, pp 2, dp 2 x tp 2 x pp 2 and, where the trainer has it, cp 2) and compares each
step's loss with the single-process CPU run of the same seed and global batch (the trainer's
ground truth, as tests/test_fast_equivalence.py): the largest relative difference must stay
under :data:`CPU_RTOL` (same arithmetic, different summation order) or, on a GPU,
:data:`GPU_RTOL` (CUDA's fp64 kernels round differently from the CPU's).

* On CPU (no CUDA device): each check over Gloo and again over the shared-memory transport
  (``--transport shm``).
* With CUDA devices: each check on NCCL (``--device cuda``: one device per rank, so a check that
  needs more ranks than there are devices is skipped and says so), then throughput: a
  Llama-3.2-1B-shaped model (models/registry.py's sizes, 2048-token sequences: :func:`llama_1b_2k`)
  in bf16 autocast under ddp, zero3 and tp over all devices; tokens/s per device, MFU against the
  device's peak (:mod:`distrain.costmodel.devices`) and ``distrain plan``'s prediction for the
  same layout beside it.

Results: a JSON file and a table (:func:`format_table`). Each run has a time limit, and checks
that would start after :data:`BUDGET_S` are skipped, so the whole command ends within about 8
minutes. The GPU form has not been run yet (docs/cost_model.md, "Self-test").
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import fields
from pathlib import Path

from distrain.errors import DistrainError

CPU_RTOL = 1e-10
GPU_RTOL = 1e-6
BUDGET_S = 420.0  # no new check starts after this; the slowest one then ends within about a minute
MODEL = "llama-small"
BASE = dict(model=MODEL, data="shakespeare", steps=5, batch_size=8, lr=1e-2, dtype="float64", eval_every=0,
            sample_chars=0, progress=False, report=False, log_every=1, timeout=120, overwrite=True)
CHECKS: list[tuple[str, dict]] = [
    ("ddp", dict(strategy="ddp", nproc=2)),
    ("torch-ddp", dict(strategy="torch-ddp", nproc=2)),
    ("zero1", dict(strategy="zero1", nproc=2)),
    ("zero2", dict(strategy="zero2", nproc=2)),
    ("zero3", dict(strategy="zero3", nproc=2)),
    ("tp2", dict(strategy="ddp", nproc=2, tp=2)),
    ("pp2", dict(strategy="ddp", nproc=2, pp=2, microbatches=2)),
    ("dp2xtp2xpp2", dict(strategy="ddp", nproc=8, dp=2, tp=2, pp=2, microbatches=2)),
    ("cp2", dict(strategy="ddp", nproc=2, cp=2)),  # only where TrainConfig has cp (parallel/context_parallel)
    ("ep2", dict(strategy="ddp", nproc=2, ep=2, model="llama-moe-tiny")),  # experts: against its own one process
]
THROUGHPUT = [("ddp", dict(strategy="ddp")), ("zero3", dict(strategy="zero3")), ("tp", dict(strategy="ddp"))]


def llama_1b_2k():
    """The Llama-3.2-1B shape (16 blocks, hidden 2048, 32/8 heads, SwiGLU 8192, vocabulary 128256)
    with 2048-token sequences: the throughput model (``--model distrain.selftest:llama_1b_2k``)."""
    from distrain.models import build_model

    return build_model("llama-3.2-1b", block_size=2048)


def _losses(out: Path) -> list[float]:
    from distrain.trainer.metrics import read_metrics

    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def _train(out: Path, **kw) -> dict:
    from distrain.trainer import TrainConfig, train

    return train(TrainConfig(**{**BASE, "out": str(out), **kw}))


def _has_fields(kw: dict) -> bool:
    from distrain.trainer import TrainConfig

    names = {f.name for f in fields(TrainConfig)}
    return all(k in names for k in kw)


def correctness(out: Path, device: str, gpus: int, deadline: float, only=None, transports=None) -> list[dict]:
    """Every check against the single-process CPU fp64 run; one record per check and transport."""
    refs: dict[str, list[float]] = {}  # model -> the single-process CPU losses, computed when first needed

    def reference(model: str) -> list[float]:
        if model not in refs:
            where = out / ("reference" if model == MODEL else f"reference-{model}")
            refs[model] = _losses_of(where, strategy="single", nproc=1, device="cpu", model=model)
        return refs[model]

    rtol = GPU_RTOL if device == "cuda" else CPU_RTOL
    ways = ["nccl"] if device == "cuda" else (transports or ["gloo", "shm"])
    records = []
    for name, kw in CHECKS:
        if only and name not in only:
            continue
        for way in ways:
            rec = dict(check=name, backend=way, nproc=kw["nproc"], tolerance=rtol, status="skip", reason="")
            records.append(rec)
            if not _has_fields(kw):
                rec["reason"] = f"this trainer has no {', '.join(k for k in kw if not _has_fields({k: 0}))}"
                continue
            if device == "cuda" and kw["nproc"] > gpus:
                rec["reason"] = f"needs {kw['nproc']} GPUs (one per rank), {gpus} visible"
                continue
            if time.monotonic() > deadline:
                rec["reason"] = "out of time (the selftest's budget)"
                continue
            extra = dict(device=device, transport="shm" if way == "shm" else "torch")
            t0 = time.monotonic()
            try:
                got = _losses_of(out / f"{name}-{way}", **kw, **extra)
            except DistrainError as e:
                rec.update(status="fail", reason=str(e).splitlines()[0][:300], seconds=round(time.monotonic() - t0, 1))
                continue
            ref = reference(kw.get("model", MODEL))
            diff = max((abs(a - b) / abs(b) for a, b in zip(got, ref)), default=float("inf"))
            ok = len(got) == len(ref) and diff <= rtol
            rec.update(status="pass" if ok else "fail", max_rel_diff=diff, seconds=round(time.monotonic() - t0, 1),
                       reason="" if ok else f"losses {got} against {ref}")
    return records


def _losses_of(out: Path, **kw) -> list[float]:
    _train(out, **kw)
    return _losses(out)


def _device_preset(name: str) -> str | None:
    """The planner's device for torch.cuda.get_device_name's answer, or None."""
    n = name.upper()
    if "H200" in n:
        return "h200"
    if "H100" in n:
        return "h100"
    if "A100" in n:
        return "a100-80g" if "80G" in n else "a100-40g"
    return None


def throughput(out: Path, gpus: int, gpu_name: str, deadline: float) -> list[dict]:
    """tokens/s per device and MFU of the 1B shape in bf16 under ddp, zero3 and tp over ``gpus`` devices."""
    from distrain.costmodel.devices import device as preset
    from distrain.costmodel.links import INTRA, LINKS
    from distrain.costmodel.shapes import preset_shape, with_positions
    from distrain.costmodel.step import Case, Cluster, Layout

    shape = with_positions(preset_shape("llama-3.2-1b"), 2048)
    dev_name = _device_preset(gpu_name)
    records = []
    for name, kw in THROUGHPUT:
        tp = gpus if name == "tp" else 1
        rec = dict(run=name, gpus=gpus, tp=tp, status="skip", reason="")
        records.append(rec)
        if name == "tp" and (gpus < 2 or shape.kv_heads % gpus):
            rec["reason"] = f"tensor parallelism needs 2+ GPUs dividing the 8 key/value heads; {gpus} visible"
            continue
        if time.monotonic() > deadline:
            rec["reason"] = "out of time (the selftest's budget)"
            continue
        batch = 4 * gpus // tp  # 4 sequences of 2048 tokens per data-parallel rank
        t0 = time.monotonic()
        try:
            s = _train(out / f"perf-{name}", model="distrain.selftest:llama_1b_2k", steps=12, batch_size=batch,
                       lr=1e-4, dtype="float32", autocast="bf16", device="cuda", nproc=gpus, tp=tp,
                       algorithm="native", timeout=240, **kw)
        except DistrainError as e:
            rec.update(status="fail", reason=str(e).splitlines()[0][:300])
            continue
        tps = s["tokens_per_s"] / gpus
        rec.update(status="pass", seconds=round(time.monotonic() - t0, 1), tokens_per_s=s["tokens_per_s"],
                   tokens_per_s_per_device=tps)
        if dev_name:
            dev = preset(dev_name)
            rec["mfu"] = tps * shape.model_flops_per_token(2048) / dev.bf16_flops
            layout = Layout(dp=gpus // tp, tp=tp, zero=3 if name == "zero3" else 0, micro_batch=4)
            case = Case(shape, Cluster(dev, 1, gpus, LINKS["ib-400g"], INTRA[dev.intra]), layout, batch, 2048)
            rec["planner_tokens_per_s_per_device"] = case.predict().tokens_per_s
            rec["device_preset"] = dev_name
    return records


def run(out: str = "runs/selftest", only=None, transports=None, throughput_runs: bool = True) -> dict:
    """The whole self-test on this machine; writes ``out``/selftest.json and returns its contents."""
    import torch

    start = time.monotonic()
    deadline = start + BUDGET_S
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = "cuda" if gpus else "cpu"
    gpu_name = torch.cuda.get_device_name(0) if gpus else ""
    result = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), host=platform.node(),
                  cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                  torch=torch.__version__, device=device, gpus=gpus, gpu=gpu_name, model=MODEL,
                  correctness=correctness(root, device, gpus, deadline, only, transports))
    result["throughput"] = throughput(root, gpus, gpu_name, deadline) if gpus and throughput_runs else []
    result["seconds"] = round(time.monotonic() - start, 1)
    result["passed"] = all(r["status"] != "fail" for r in result["correctness"] + result["throughput"])
    (root / "selftest.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict) -> str:
    lines = [f"# distrain selftest on {result['device']}{' (' + result['gpu'] + ')' if result['gpu'] else ''}, "
             f"{result['gpus']} GPU(s), {result['cores']} cores, torch {result['torch']}: {result['seconds']} s",
             f"{'check':<14} {'backend':<8} {'ranks':>5} {'status':<6} {'max rel diff':>13} {'tolerance':>10}  note"]
    for r in result["correctness"]:
        diff = f"{r['max_rel_diff']:.2e}" if "max_rel_diff" in r else "-"
        lines.append(f"{r['check']:<14} {r['backend']:<8} {r['nproc']:>5} {r['status']:<6} {diff:>13} "
                     f"{r['tolerance']:>10.0e}  {r.get('reason', '')}")
    if result["throughput"]:
        lines.append(f"{'throughput':<14} {'gpus':>5} {'tp':>3} {'status':<6} {'tok/s/dev':>10} {'MFU %':>6} "
                     f"{'plan tok/s/dev':>15}  note")
        for r in result["throughput"]:
            tps = f"{r['tokens_per_s_per_device']:,.0f}" if "tokens_per_s_per_device" in r else "-"
            mfu = f"{100 * r['mfu']:.1f}" if "mfu" in r else "-"
            plan = f"{r['planner_tokens_per_s_per_device']:,.0f}" if "planner_tokens_per_s_per_device" in r else "-"
            lines.append(f"{r['run']:<14} {r['gpus']:>5} {r['tp']:>3} {r['status']:<6} {tps:>10} {mfu:>6} {plan:>15}  "
                         f"{r.get('reason', '')}")
    lines.append("passed" if result["passed"] else "FAILED")
    return "\n".join(lines)
