"""Memory accounting for data-parallel strategies: what a rank holds, measured and by formula.

Measured: the bytes of the distinct storages behind a strategy's parameters, gradients and
optimizer state (``resident_bytes``; a view counts once with its base; a DTensor counts its
local shard), and the process's peak resident set size above a baseline (``PeakRSS``: Linux
resets the high-water mark when "5" is written to /proc/self/clear_refs).

Formulas, Rajbhandari et al., "ZeRO" (SC'20), section 5, for Psi parameters on N ranks:

* mixed precision Adam (fp16 parameters and gradients 2+2 bytes, fp32 master copy,
  momentum and variance K = 12 bytes): DDP 16 Psi; stage 1 4 Psi + 12 Psi/N;
  stage 2 2 Psi + 14 Psi/N; stage 3 16 Psi/N  (``paper_bytes``);
* what distrain runs on CPU (one dtype of e bytes, no master copy; AdamW keeps 2 values per
  parameter, SGD with momentum 1): parameters e Psi (stage 3: e Psi/N), gradients e Psi
  (stages 2-3: e Psi/N), optimizer state k e Psi/N (stages 1-3) or k e Psi (DDP)
  (``model_bytes``). With e = 4 and AdamW that is 16 Psi for DDP, like the paper.
"""

from __future__ import annotations

import torch

PAPER = {0: (2, 2, 12, False, False, False), 1: (2, 2, 12, False, False, True),
         2: (2, 2, 12, False, True, True), 3: (2, 2, 12, True, True, True)}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def resident_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (None entries ignored)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None or not torch.is_tensor(t):
            continue
        s = _local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(opt) -> list[torch.Tensor]:
    """Every tensor in an optimizer's per-parameter state (scalar step counters included)."""
    inner = getattr(opt, "optim", opt)  # torch's ZeroRedundancyOptimizer wraps a local optimizer
    return [v for st in inner.state.values() for v in st.values() if torch.is_tensor(v)]


def _split(stage: int, psi: int, n: int, p_b: float, g_b: float, o_b: float) -> dict[str, float]:
    return {"params": p_b * psi / (n if stage >= 3 else 1), "grads": g_b * psi / (n if stage >= 2 else 1),
            "optimizer": o_b * psi / (n if stage >= 1 else 1)}


def paper_bytes(stage: int, psi: int, n: int) -> dict[str, float]:
    """The paper's mixed-precision Adam bytes per rank (stage 0 = DDP): params, grads, optimizer, total."""
    d = _split(stage, psi, n, 2, 2, 12)
    d["total"] = sum(d.values())
    return d


def model_bytes(stage: int, psi: int, n: int, elem: int = 4, opt_values: int = 2) -> dict[str, float]:
    """The same accounting for one dtype of ``elem`` bytes and ``opt_values`` state values per parameter."""
    d = _split(stage, psi, n, elem, elem, elem * opt_values)
    d["total"] = sum(d.values())
    return d


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set size now (Linux)."""
    return _status("VmRSS")


class PeakRSS:
    """Peak resident memory of this process above the RSS at ``start()`` (Linux only)."""

    def __init__(self) -> None:
        self.base = 0

    @staticmethod
    def available() -> bool:
        try:
            _status("VmHWM")
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # high-water mark := current RSS
        self.base = _status("VmRSS")

    def peak(self) -> int:
        return _status("VmHWM") - self.base
