"""torch's own distributed tests, run with ``distrain.comm`` in place of ``torch.distributed``.

torch ships its test suite for torch.distributed inside the wheel
(``torch/testing/_internal/distributed/distributed_test.py``). Its collective and P2P test
methods are written against a module-level ``dist``; this harness replaces that name with
``distrain.comm`` whose communication functions are bound to one ``algorithm=`` (native,
star, ring or tree), and runs the methods with torch's own multi-process test runner
(one fresh process per rank, Gloo, file:// rendezvous).

    python tests/conformance_torch.py --algorithm all --world-size 2,3,4
    python tests/conformance_torch.py --algorithm ring --world-size 3 -k all_reduce -v

It prints, per algorithm and world size, how many methods passed, failed, were skipped by
torch's own decorators (e.g. "needs world size >= 3") and timed out (a hang: each method
runs under torch's per-test timeout, here DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=90 s), and
writes the per-method outcomes as JSON with ``--json``.

What is changed in torch's tests, and why:

* ``dist`` is ``distrain.comm`` with the communication functions bound to the algorithm.
  The names ``COMM_FUNCTIONS`` come from distrain.comm only: when distrain.comm lacks one,
  the call fails (that is what "missing" means); process-group helpers that distrain.comm lacks
  (older versions) come from torch.distributed, so a test measures the communication.
* Profiler-event assertions are off (``PROFILING_SUPPORTED_BACKENDS = []``): they count
  Gloo's internal events, which our algorithms (made of P2P messages) cannot produce.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import types
import unittest

ALGORITHMS = ("native", "star", "ring", "tree")
ENV_ALG = "DISTRAIN_CONFORMANCE_ALGORITHM"
ALG = os.environ.get(ENV_ALG, "native")
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "90")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

import torch.distributed as _torch_dist  # noqa: E402
import torch.testing._internal.distributed.distributed_test as _dt  # noqa: E402

import distrain.comm as _comm  # noqa: E402

# Everything the tests call that moves data: taken from distrain.comm, bound to the algorithm.
COMM_FUNCTIONS = (
    "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter", "barrier",
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced", "all_gather_coalesced",
    "all_to_all", "all_to_all_single", "all_gather_object", "gather_object", "scatter_object_list",
    "broadcast_object_list", "send_object_list", "recv_object_list", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "P2POp",
)
TAKES_ALGORITHM = {"broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather", "reduce_scatter",
                   "barrier", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce_coalesced",
                   "all_gather_coalesced", "all_to_all", "all_to_all_single", "all_gather_object",
                   "gather_object", "scatter_object_list", "broadcast_object_list"}

# torch's collective and P2P methods (DDP, model averaging, NCCL/CUDA and profiler-only tests left out)
SELECT = re.compile(r"^test_(all_reduce|reduce|broadcast|scatter|gather|all_gather|all_to_all|barrier|"
                    r"send_recv|isend|irecv|batch_isend_irecv|monitored_barrier|sparse_all_reduce|"
                    r"get_rank_size|destroy|new_subgroups|reduce_scatter)")
EXCLUDE = re.compile(r"ddp|cuda|nccl|gpu|profil|mixed_backend|_sum_cuda|coalesced_max_complex_unsupported$")


def _missing(name: str):
    def fail(*args, **kwargs):
        raise AttributeError(f"distrain.comm has no {name}")
    return fail


def _bind(fn, name: str):
    if name not in TAKES_ALGORITHM:
        return fn

    def bound(*args, **kwargs):
        kwargs.setdefault("algorithm", ALG)
        return fn(*args, **kwargs)

    bound.__name__ = name
    return bound


def make_shim(algorithm: str) -> types.ModuleType:
    """distrain.comm, its communication functions bound to ``algorithm``, as a module object."""
    shim = types.ModuleType("distrain_comm_" + algorithm)
    for name in COMM_FUNCTIONS:
        fn = getattr(_comm, name, None)
        setattr(shim, name, _missing(name) if fn is None else _bind(fn, name))
    # torch's P2POp checks op is torch's isend/irecv; ours takes either, by name
    shim.__getattr__ = lambda n: getattr(_comm, n) if hasattr(_comm, n) else getattr(_torch_dist, n)
    return shim


_dt.dist = make_shim(ALG)
_dt.PROFILING_SUPPORTED_BACKENDS = []


class TestDistrainAsTorch(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """torch's test methods; every rank is a fresh process started by torch's runner."""

    def setUp(self):
        super().setUp()
        self._spawn_processes()


def selected(patterns: list[str] | None = None) -> list[str]:
    names = sorted(n for n in dir(_dt.DistributedTest._DistTestBase)
                   if SELECT.match(n) and not EXCLUDE.search(n))
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    return names


class _Outcomes(unittest.TestResult):
    def __init__(self):
        super().__init__()
        self.rows: dict[str, str] = {}
        self.detail: dict[str, str] = {}

    def _name(self, test) -> str:
        return test.id().rsplit(".", 1)[-1]

    def addSuccess(self, test):
        self.rows[self._name(test)] = "pass"

    def _bad(self, test, err):
        text = self._exc_info_to_string(err, test)
        self.rows[self._name(test)] = "timeout" if "timed out after" in text else "fail"
        self.detail[self._name(test)] = text[-1500:]

    addFailure = addError = _bad

    def addSkip(self, test, reason):
        self.rows[self._name(test)] = "skip"
        self.detail[self._name(test)] = reason


def _worker(names: list[str]) -> None:
    """Run the named methods in this process (its environment says the algorithm and world size)."""
    result = _Outcomes()
    unittest.TestSuite(TestDistrainAsTorch(n) for n in names).run(result)
    print("CONFORMANCE " + json.dumps({"rows": result.rows, "detail": result.detail}), flush=True)


def run(algorithm: str, world_size: int, names: list[str], timeout: float) -> dict:
    """One subprocess per (algorithm, world size): its module-level shim is bound at import."""
    with tempfile.TemporaryDirectory(prefix="distrain-conf-") as tmp:
        env = dict(os.environ, **{ENV_ALG: algorithm, "WORLD_SIZE": str(world_size), "TEMP_DIR": tmp,
                                  "BACKEND": "gloo"})
        t0 = time.monotonic()
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *names], env=env,
                               capture_output=True, text=True, timeout=timeout)
            out = p.stdout
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        secs = time.monotonic() - t0
    line = next((x for x in out.splitlines() if x.startswith("CONFORMANCE ")), None)
    got = json.loads(line[len("CONFORMANCE "):]) if line else {"rows": {}, "detail": {}}
    for n in names:  # a worker killed by the overall timeout: what it did not report hung
        got["rows"].setdefault(n, "timeout")
    got["seconds"] = round(secs, 1)
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="all", help="native, star, ring, tree, comma-separated, or all")
    ap.add_argument("--world-size", default="2,3,4", help="comma-separated world sizes (default 2,3,4)")
    ap.add_argument("-k", action="append", help="run only methods whose name contains this (repeatable)")
    ap.add_argument("--json", help="write every method's outcome here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per (algorithm, world size) run")
    ap.add_argument("-v", action="store_true", help="print each failure's traceback tail")
    ap.add_argument("--list", action="store_true", help="list the selected methods and exit")
    ap.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        _worker(a.worker)
        return 0
    names = selected(a.k)
    if a.list:
        print("\n".join(names))
        return 0
    algs = ALGORITHMS if a.algorithm == "all" else tuple(a.algorithm.split(","))
    bad_alg = [x for x in algs if x not in ALGORITHMS]
    if bad_alg:
        ap.error(f"--algorithm: unknown {bad_alg}; use {', '.join(ALGORITHMS)} or all")
    sizes = [int(x) for x in a.world_size.split(",")]
    report, failed = {}, 0
    t0 = time.monotonic()
    print(f"{len(names)} torch test methods; algorithms {', '.join(algs)}; world sizes {sizes}")
    for alg in algs:
        for ws in sizes:
            got = run(alg, ws, names, a.timeout)
            report[f"{alg}/{ws}"] = got
            c = {k: sum(v == k for v in got["rows"].values()) for k in ("pass", "fail", "skip", "timeout")}
            failed += c["fail"] + c["timeout"]
            print(f"{alg:6s} P={ws}: {c['pass']:3d} passed, {c['fail']:3d} failed, {c['skip']:3d} skipped, "
                  f"{c['timeout']} timed out  ({got['seconds']:.0f} s)", flush=True)
            if a.v:
                for n, d in sorted(got["detail"].items()):
                    if got["rows"].get(n) in ("fail", "timeout"):
                        print(f"--- {alg} P={ws} {n}:\n{d}")
    print(f"total {time.monotonic() - t0:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, sort_keys=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
