"""Devices for the planner: peak FLOP/s, memory, and the fractions of peak real kernels reach.

Each :class:`Device` holds its data-sheet numbers (dense, no sparsity) and three measured
fractions, all with their sources; no value is fitted to a training run:

* ``gemm_eff``: the largest share of the bf16 peak a matmul reaches, the Maximum Achievable
  Matmul FLOPS (MAMF) of S. Bekman's *Machine Learning Engineering* (github.com/stas00/
  ml-engineering, compute/accelerator/README.md, "Maximum Achievable Matmul FLOPS comparison
  table": A100 SXM 271.2 of 312 TFLOPS, H100 SXM 794.5 of 989, "H200 is the same"). Smaller or
  ragged matmuls get less: :mod:`distrain.costmodel.kernels` applies tile and wave quantization;
* ``fa2_eff``, ``fa3_eff``: fused (flash) attention's share of the peak, forward and backward,
  the middle of each published range: FlashAttention-2 (Dao, ICLR 2024, abstract) reaches
  50-73 % of the A100's peak (0.615) and 35 % of the H100's (Shah et al., FlashAttention-3,
  NeurIPS 2024, abstract); FlashAttention-3 is 1.5-2.0x faster than that (0.35 x 1.75 = 0.61;
  Hopper only; cuDNN's fused attention in Transformer Engine, which Megatron-Core uses, is of
  the same kind);
* ``mem_eff``: the share of the HBM bandwidth element-wise kernels reach (0.8: STREAM-like
  copies on A100/H100 reach 80-90 % of the data-sheet bandwidth, e.g. NVIDIA's
  "CUDA C++ Best Practices Guide", effective bandwidth; we take the low end).

``cpu`` is this repository's 2-core test host, measured with :func:`measure_host` (the numbers
in :data:`DEVICES` are one such run, docs/cost_model_data/cpu_host.json); its links are the
ones ``distrain bench link`` calibrates (``--calibration``), or the ``shm``/``eth-*`` presets.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace

from distrain.errors import ConfigError


@dataclass(frozen=True)
class Device:
    name: str
    bf16_flops: float  # dense bf16 tensor-core peak, FLOP/s
    fp32_flops: float  # dense fp32 (non-tensor) peak, FLOP/s
    memory: float  # bytes
    mem_bw: float  # bytes/s, data sheet
    sms: int  # streaming multiprocessors (wave quantization); 1 for a CPU
    gemm_eff: float
    fa2_eff: float  # FlashAttention-2 (PyTorch's SDPA flash kernel)
    fa3_eff: float | None  # FlashAttention-3 / cuDNN fused attention (Hopper only); None: not available
    mem_eff: float = 0.8
    intra: str = "nvlink4"  # the links.INTRA preset between the devices of one node
    family: str = "hopper"  # the chip: its sustained efficiencies (SUSTAINED) are fitted per family
    source: str = ""

    def peak(self, dtype: str = "bf16") -> float:
        return self.bf16_flops if dtype == "bf16" else self.fp32_flops

    def attn_eff(self, kernel: str) -> float:
        """The fused attention kernel's share of the peak; ``fa3`` falls back to ``fa2`` where it does not run."""
        return self.fa3_eff if kernel == "fa3" and self.fa3_eff else self.fa2_eff

    def sustained(self, multipliers: tuple[float, float, float] | None = None) -> "Device":
        """This device with the efficiencies a training step sustains: the nominal ones divided by
        the family's fitted (matmul, attention, element-wise) time multipliers (:data:`SUSTAINED`)."""
        g, a, e = multipliers or SUSTAINED.get(self.family, (1.0, 1.0, 1.0))
        return replace(self, gemm_eff=self.gemm_eff / g, fa2_eff=self.fa2_eff / a,
                       fa3_eff=self.fa3_eff / a if self.fa3_eff else None, mem_eff=self.mem_eff / e)


_H100 = ("NVIDIA H100 Tensor Core GPU data sheet (SXM5): BF16 1,979 TFLOPS with sparsity = 989.4 dense, FP32 67 "
         "TFLOPS, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s; 132 SMs (NVIDIA H100 architecture white paper)")
_H200 = ("NVIDIA H200 Tensor Core GPU data sheet (SXM): BF16 1,979 TFLOPS with sparsity = 989.4 dense, FP32 67 TFLOPS, "
         "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s; the H100's 132 SMs")
_A100 = ("NVIDIA A100 Tensor Core GPU data sheet (SXM4): BF16 312 TFLOPS dense, FP32 19.5 TFLOPS, {mem}, NVLink "
         "600 GB/s; 108 SMs (NVIDIA A100 architecture white paper)")
_MAMF_H100, _MAMF_A100 = 794.5 / 989.4, 271.2 / 312.0
_FA2_A100, _FA2_H100, _FA3_H100 = (0.50 + 0.73) / 2, 0.35, 0.35 * (1.5 + 2.0) / 2

# the test host (AMD EPYC, 2 cores, 25 GB): measure_host() on 2026-11-27 02:30 UTC, load average 3 from other
# sessions (docs/cost_model_data/cpu_host.json); its bf16 matmuls ran faster than its fp32 ones
CPU_HOST = dict(fp32_flops=67.2e9, bf16_flops=236.5e9, mem_bw=16.6e9, memory=25.3e9)

DEVICES: dict[str, Device] = {
    "h100": Device("h100", 989.4e12, 67e12, 80e9, 3.35e12, 132, _MAMF_H100, _FA2_H100, _FA3_H100, source=_H100),
    "h200": Device("h200", 989.4e12, 67e12, 141e9, 4.8e12, 132, _MAMF_H100, _FA2_H100, _FA3_H100, source=_H200),
    # torchtitan's benchmark H100s (benchmarks/llama3_h100_202412_torchtitan.md): 96 GB HBM2e at 2.4 TB/s, 500 W;
    # "the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value": the SXM's, as there
    "h100-hbm2e": Device("h100-hbm2e", 989.4e12, 67e12, 96e9, 2.4e12, 132, _MAMF_H100, _FA2_H100, _FA3_H100,
                         source="torchtitan benchmarks/llama3_h100_202412_torchtitan.md (96 GB HBM2e, 2.4 TB/s, "
                                "500 W); peak taken as the H100 SXM's (an upper bound, as torchtitan says)"),
    "a100-40g": Device("a100-40g", 312e12, 19.5e12, 40e9, 1.555e12, 108, _MAMF_A100, _FA2_A100, None, intra="nvlink3",
                       family="ampere", source=_A100.format(mem="40 GB HBM2 at 1,555 GB/s")),
    "a100-80g": Device("a100-80g", 312e12, 19.5e12, 80e9, 2.039e12, 108, _MAMF_A100, _FA2_A100, None, intra="nvlink3",
                       family="ampere", source=_A100.format(mem="80 GB HBM2e at 2,039 GB/s")),
    # a CPU's matmuls already run at their measured rate (gemm_eff 1), attention as a plain matmul would
    "cpu": Device("cpu", CPU_HOST["bf16_flops"], CPU_HOST["fp32_flops"], CPU_HOST["memory"], CPU_HOST["mem_bw"], 1,
                  1.0, 0.5, None, mem_eff=1.0, intra="shm", family="cpu",
                  source="this repository's 2-core test host, measured by distrain.costmodel.devices.measure_host "
                         "(docs/cost_model_data/cpu_host.json)"),
}
# Sustained time multipliers (matmul, attention, element-wise) per chip family: how much longer each kind of
# kernel took in published training runs than the nominal efficiencies above predict. Fitted once, by
# distrain.costmodel.calibration.fit on the MosaicML rows that the validation does not use
# (docs/cost_model_data/mosaicml_benchmarks.csv; docs/cost_model.md, "How the constants were fixed"), and
# checked against a re-fit by tests/test_costmodel_gpu.py. The CPU host has no published runs: none.
SUSTAINED: dict[str, tuple[float, float, float]] = {
    "ampere": (1.138, 1.907, 2.073),  # from 123 A100 runs (40 and 80 GB)
    "hopper": (1.239, 1.925, 2.18),  # from 32 single-node H100 runs
}
ALIASES = {"a100": "a100-80g", "h100-sxm": "h100", "h200-sxm": "h200"}


def device(name: str) -> Device:
    """The preset ``name`` (case-insensitive; ``a100`` is the 80 GB SXM); a one-line error otherwise."""
    key = ALIASES.get(name.lower(), name.lower())
    if key not in DEVICES:
        raise ConfigError(f"--device {name!r}: unknown device; choose from {', '.join(DEVICES)} (or "
                          f"{', '.join(ALIASES)})")
    return DEVICES[key]


def measure_host(seconds: float = 1.0, threads: int | None = None) -> dict:
    """This host's matmul FLOP/s (fp32 and bf16, a 1024^3 matmul on ``threads`` cores, the process's
    setting by default), its copy bandwidth (a 64 MiB tensor copied: read + write bytes per second) and
    its memory (MemTotal); the process's thread count is restored afterwards."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _measure(torch, seconds)
    finally:
        torch.set_num_threads(before)


def _measure(torch, seconds: float) -> dict:
    def rate(fn, work: float) -> float:
        fn()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 3 or n < 2:
            fn()
            n += 1
        return work * n / (time.perf_counter() - t0)

    out = {}
    for key, dtype in (("fp32_flops", torch.float32), ("bf16_flops", torch.bfloat16)):
        a = torch.randn(1024, 1024, dtype=dtype)
        b = torch.randn(1024, 1024, dtype=dtype)
        out[key] = rate(lambda: a @ b, 2.0 * 1024 ** 3)
    src = torch.empty(16 << 20, dtype=torch.float32)
    dst = torch.empty_like(src)
    out["mem_bw"] = rate(lambda: dst.copy_(src), 2.0 * src.numel() * 4)
    mem = 0.0
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as f:
            mem = float(f.readline().split()[1]) * 1024
    out["memory"] = mem
    out["threads"] = torch.get_num_threads()
    return out


def report_host(json_path: str | None = None) -> int:
    """Measure this host, print the record as JSON, write it to ``json_path`` (``distrain plan --measure-host``)."""
    res = measure_host()
    res["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    print(json.dumps(res, indent=1))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    return 0
