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
    # "infra": the method's process group never started (its ranks' init_process_group timed out on a loaded
    # host: the machine, not the method). Those methods run once more, alone; a failure is never rerun.
    again = {k: [n for n in FAST if got["rows"].get(n) == "infra"] for k, got in report.items()}
    for key, names in again.items():
        if names:
            retry = tmp_path / key.replace("/", "-")
            retry.mkdir()
            got = _harness(retry, key.split("/")[0], "3", names, timeout=600)[key]
            for n in names:
                report[key]["rows"][n] = got["rows"].get(n, "not run")
                report[key]["detail"][n] = got["detail"].get(n, "")
    for key, got in report.items():  # (-k matches substrings: a few more methods ran; these must pass)
        bad = {n: got["rows"].get(n, "not run") + ": " + got["detail"].get(n, "")[-600:]
               for n in FAST if got["rows"].get(n) != "pass"}
        assert not bad, f"{key}: {bad}"


ALGORITHMS = ("native", "star", "ring", "tree")
SIZES = (2, 3, 4)


def _selected(names: list[str] | None = None) -> list[str]:
    """The methods the harness runs (``-k`` each of ``names``): its own ``--list``."""
    cmd = [sys.executable, HARNESS, "--list"] + [a for n in names or [] for a in ("-k", n)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.split()


def check_long_report(report: dict, names: list[str], algorithms=ALGORITHMS, sizes=SIZES) -> None:
    """The long run's verdict (AssertionError naming what is wrong): methods were selected; every
    algorithm and torch itself ran every one of them at every world size, and at least one passed
    there (a report that ran nothing, or whose process groups never started, proves nothing); none
    hung; none failed where torch passes."""
    assert names, "no torch test method was selected: the harness found none to run"
    for ws in sizes:
        for alg in ("torch", *algorithms):
            key = f"{alg}/{ws}"
            assert key in report, f"{key}: not in the report (it has {sorted(report)})"
            rows = report[key]["rows"]
            missing = sorted(set(names) - set(rows))
            assert not missing, f"{key}: {len(missing)} of {len(names)} methods have no outcome: {missing[:10]}"
            assert "pass" in rows.values(), f"{key}: no method passed ({sorted(set(rows.values()))})"
        base = report[f"torch/{ws}"]["rows"]
        for alg in algorithms:
            rows = report[f"{alg}/{ws}"]["rows"]
            hung = [n for n, v in rows.items() if v == "timeout"]
            assert not hung, f"{alg} P={ws}: hung in {hung}"
            worse = [n for n, v in rows.items() if v == "fail" and base.get(n) == "pass"]
            assert not worse, f"{alg} P={ws}: fail where torch passes: {worse}"


def test_the_long_verdict_fails_on_a_report_that_ran_nothing():
    """check_long_report on reports whose answer is known: only a complete one with passes passes."""
    names = ["test_a", "test_b"]
    good = {f"{a}/2": {"rows": {"test_a": "pass", "test_b": "skip"}} for a in ("torch", "ring")}
    check_long_report(good, names, ("ring",), (2,))
    bad = {
        "empty report": ({}, names),
        "nothing selected": (good, []),
        "no rows": ({k: {"rows": {}} for k in good}, names),
        "a method without outcome": (good | {"ring/2": {"rows": {"test_a": "pass"}}}, names),
        "nothing passed": ({k: {"rows": {"test_a": "skip", "test_b": "skip"}} for k in good}, names),
        "process groups never started": ({k: {"rows": {"test_a": "infra", "test_b": "infra"}} for k in good}, names),
        "a hang": (good | {"ring/2": {"rows": {"test_a": "pass", "test_b": "timeout"}}}, names),
        "a failure where torch passes": (good | {"ring/2": {"rows": {"test_a": "fail", "test_b": "skip"}}}, names),
        "an algorithm missing": ({"torch/2": good["torch/2"]}, names),
    }
    for what, (report, selected) in bad.items():
        with pytest.raises(AssertionError):
            check_long_report(report, selected, ("ring",), (2,))
            raise RuntimeError(f"check_long_report accepted a report with {what}")


@pytest.mark.slow
@pytest.mark.conformance
@pytest.mark.timeout(7200)
def test_every_method_every_algorithm_every_world_size(tmp_path):
    names = _selected()
    report = _harness(tmp_path, ",".join(("torch",) + ALGORITHMS), ",".join(map(str, SIZES)), None, timeout=7000)
    check_long_report(report, names)
