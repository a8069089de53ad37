"""torch's own distributed tests against distrain.comm (tests/conformance_torch.py), asserted.

* fast (in `make test`): a handful of torch's methods, one per family that issue 10 fixed or
  added, on two of our algorithms at world size 3: every one must pass;
* long (``-m conformance``): every selected method, every algorithm, world sizes 2-4: no method
  may hang, and every method that fails must also fail under torch itself in this runner
  (the baseline: the methods that need GPUs, exact timings or a larger world).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conformance_torch.py")
FAST = ["test_all_reduce_sum", "test_broadcast", "test_all_to_all_single_unequal_split",
        "test_send_recv_any_source", "test_all_gather_object_default_pg", "test_all_reduce_coalesced_sum",
        "test_scatter_object_list", "test_all_reduce_complex_unsupported_ops"]


def _harness(tmp_path, algorithms: str, sizes: str, names: list[str] | None, timeout: float) -> dict:
    out = tmp_path / "conformance.json"
    cmd = [sys.executable, HARNESS, "--algorithm", algorithms, "--world-size", sizes, "--json", str(out)]
    for n in names or []:
        cmd += ["-k", n]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.timeout(900)
def test_torch_methods_pass_on_our_algorithms(tmp_path):
    report = _harness(tmp_path, "ring,tree", "3", FAST, timeout=850)
    assert sorted(report) == ["ring/3", "tree/3"]
    for key, got in report.items():  # (-k matches substrings: a few more methods ran; these must pass)
        bad = {n: got["rows"].get(n, "not run") + ": " + got["detail"].get(n, "")[-600:]
               for n in FAST if got["rows"].get(n) != "pass"}
        assert not bad, f"{key}: {bad}"


@pytest.mark.slow
@pytest.mark.conformance
@pytest.mark.timeout(7200)
def test_every_method_every_algorithm_every_world_size(tmp_path):
    report = _harness(tmp_path, "torch,native,star,ring,tree", "2,3,4", None, timeout=7000)
    for ws in (2, 3, 4):
        base = report[f"torch/{ws}"]["rows"]
        for alg in ("native", "star", "ring", "tree"):
            rows = report[f"{alg}/{ws}"]["rows"]
            hung = [n for n, v in rows.items() if v == "timeout"]
            assert not hung, f"{alg} P={ws}: hung in {hung}"
            worse = [n for n, v in rows.items() if v == "fail" and base.get(n) == "pass"]
            assert not worse, f"{alg} P={ws}: fail where torch passes: {worse}"
