"""``distrain selftest`` on CPU (what CI runs of it): its checks pass against one process, and a wrong run fails."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_cpu_selftest_passes_and_catches_a_wrong_run(tmp_path, monkeypatch):
    from distrain import selftest

    # a run that is not the reference's (another learning rate) must fail its check
    monkeypatch.setattr(selftest, "CHECKS", selftest.CHECKS + [("lr-off", dict(strategy="ddp", nproc=2, lr=2e-2))])
    # 3 steps, not the command's 5, for 24 runs: two updates already separate the lr-off run from one process
    # (its loss differs from step 1 on), and the layouts' equality holds at 3 steps as at 5
    monkeypatch.setitem(selftest.BASE, "steps", 3)
    result = selftest.run(str(tmp_path))  # the whole CPU form, as `distrain selftest` runs it here
    saved = json.loads((tmp_path / "selftest.json").read_text())
    assert saved["correctness"] == result["correctness"] and saved["device"] == "cpu" and saved["throughput"] == []
    got = {(r["check"], r["backend"]): r for r in saved["correctness"]}
    names = [name for name, _ in selftest.CHECKS]
    assert sorted(got) == sorted((c, b) for c in names for b in ("gloo", "shm"))
    for check in names[:-1]:
        for backend in ("gloo", "shm"):
            r = got[(check, backend)]
            assert r["status"] == "pass" and r["max_rel_diff"] <= selftest.CPU_RTOL, r
    for backend in ("gloo", "shm"):
        assert got[("lr-off", backend)]["status"] == "fail" and got[("lr-off", backend)]["max_rel_diff"] > 1e-3
    assert saved["passed"] is False
    table = selftest.format_table(saved)
    assert "lr-off" in table and table.endswith("FAILED")


def test_selftest_refuses_unknown_checks(capsys):
    from distrain.cli import main

    assert main(["selftest", "--only", "ddp,zero9"]) == 2
    assert "--only zero9: no such check; choose from ddp, torch-ddp" in capsys.readouterr().err
    assert main(["selftest", "--transports", "nccl"]) == 2
    assert "--transports nccl: choose from gloo, shm" in capsys.readouterr().err
