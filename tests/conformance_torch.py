"""torch's own distributed tests, run with ``distrain.comm`` in place of ``torch.distributed``.

torch ships its test suite for torch.distributed inside the wheel
(``torch/testing/_internal/distributed/distributed_test.py``). Its collective and P2P test
methods are written against a module-level ``dist``; this harness replaces that name with
``distrain.comm`` whose communication functions are bound to one ``algorithm=`` (native,
star, ring or tree), and runs the methods in P long-lived rank processes (torch's runner
starts P fresh interpreters per method, a minute each on a loaded 2-core machine): each
method gets a fresh Gloo default process group, its own temp directory and file barrier.

    python tests/conformance_torch.py --algorithm all --world-size 2,3,4
    python tests/conformance_torch.py --algorithm ring --world-size 3 -k all_reduce -v

It prints, per algorithm and world size, how many methods passed, failed, were skipped by
torch's own decorators (e.g. "needs world size >= 3") and timed out (a hang: a method not
finished on every rank within ``--timeout`` seconds; the ranks are then restarted at the
next method), and writes the per-method outcomes as JSON with ``--json``.

What is changed in torch's tests, and why:

* ``dist`` is ``distrain.comm`` with the communication functions bound to the algorithm.
  The names ``COMM_FUNCTIONS`` come from distrain.comm only: when distrain.comm lacks one,
  the call fails (that is what "missing" means); process-group helpers that distrain.comm lacks
  (older versions) come from torch.distributed, so a test measures the communication.
* Profiler-event assertions are off (``PROFILING_SUPPORTED_BACKENDS = []``): they count
  Gloo's internal events, which our algorithms (made of P2P messages) cannot produce.
* torch's file barrier waits up to 120 s instead of 10 s (a loaded machine, not a fault).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import types
import unittest

ALGORITHMS = ("native", "star", "ring", "tree")
BASELINE = "torch"  # --algorithm torch: torch.distributed itself, what this runner makes of torch's tests
ENV_ALG = "DISTRAIN_CONFORMANCE_ALGORITHM"
ALG = os.environ.get(ENV_ALG, "native")
os.environ.setdefault("BACKEND", "gloo")
os.environ.setdefault("WORLD_SIZE", "2")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())

import torch.distributed as _torch_dist  # noqa: E402
import torch.testing._internal.distributed.distributed_test as _dt  # noqa: E402

import distrain.comm as _comm  # noqa: E402
from dist_shim import make_shim  # noqa: E402  (tests/ is on sys.path: script dir or pytest rootdir)

# torch's collective and P2P methods (DDP, model averaging, NCCL/CUDA and profiler-only tests left out)
SELECT = re.compile(r"^test_(all_reduce|reduce|broadcast|scatter|gather|all_gather|all_to_all|barrier|"
                    r"send_recv|isend|irecv|batch_isend_irecv|monitored_barrier|sparse_all_reduce|"
                    r"get_rank_size|destroy|new_subgroups|reduce_scatter)")
EXCLUDE = re.compile(r"ddp|cuda|nccl|gpu|profil|mixed_backend|_sum_cuda|coalesced_max_complex_unsupported$")


_dt.dist = _torch_dist if ALG == "torch" else make_shim(ALG)
_dt.PROFILING_SUPPORTED_BACKENDS = []
# torch's file barrier between steps of a method gives up after 10 s; on a loaded 2-core machine
# a rank can be that late without anything being wrong
_dt.Barrier.sync.__func__.__defaults__ = (None, 120)


class TestDistrainAsTorch(_dt.TestDistBackend, _dt.DistributedTest._DistTestBase):
    """torch's test methods, run by :func:`_rank_main` inside long-lived rank processes."""


def selected(patterns: list[str] | None = None) -> list[str]:
    names = sorted(n for n in dir(_dt.DistributedTest._DistTestBase)
                   if SELECT.match(n) and not EXCLUDE.search(n))
    if patterns:
        names = [n for n in names if any(p in n for p in patterns)]
    return names


PG_TIMEOUT = 60  # seconds: a rank left waiting by a failed peer gets Gloo's error, not a hang
TEST_TIMEOUT = 180  # seconds per method before the parent declares a hang and restarts the ranks


def _run_one(name: str, rank: int, world: int, store, prefix: str, tmp: str) -> tuple[str, str]:
    """One torch test method on this rank, in a fresh default process group."""
    import traceback
    from datetime import timedelta

    from torch.testing._internal.common_distributed import TEST_SKIPS
    from torch.testing._internal.common_utils import SEED, set_rng_seed

    os.environ["TEMP_DIR"] = tmp
    os.makedirs(os.path.join(tmp, "barrier"), exist_ok=True)
    _dt.Barrier.barrier_id = 0
    _dt.INIT_METHOD = "file://" + os.path.join(tmp, "reinit_file")  # for methods that re-initialise
    set_rng_seed(SEED)  # torch's runner seeds each rank alike in setUp (random test objects must agree)
    try:
        _torch_dist.init_process_group("gloo", store=_torch_dist.PrefixStore(prefix, store), rank=rank,
                                       world_size=world, timeout=timedelta(seconds=PG_TIMEOUT))
    except RuntimeError as e:  # the machine, not the method: reported apart from failures
        return "infra", f"init_process_group failed: {e}"[:500]
    test = TestDistrainAsTorch(name)
    test.rank = rank
    test.file_name = os.path.join(tmp, "init_file")
    skip_codes = {v.exit_code: v.message for v in TEST_SKIPS.values()}
    try:
        getattr(test, name)()
        outcome = ("pass", "")
    except unittest.SkipTest as e:
        outcome = ("skip", str(e))
    except SystemExit as e:  # torch's multi-process skips exit with a code
        outcome = ("skip", skip_codes[e.code]) if e.code in skip_codes else ("fail", f"exit {e.code}")
    except BaseException:  # noqa: BLE001 - recorded, and the next method runs
        outcome = ("fail", traceback.format_exc()[-1500:])
    finally:
        if _torch_dist.is_initialized():
            getattr(_comm, "destroy_process_group", _torch_dist.destroy_process_group)()
    return outcome


def _rank_main(rank: int, world: int, port: int, names: list[str], first: int, attempt: int, base: str,
               conn) -> None:
    """A rank process: run methods first, first+1, ... and report each outcome to the parent."""
    import warnings

    warnings.simplefilter("ignore")
    store = _torch_dist.TCPStore("127.0.0.1", port, world, is_master=False)
    for i in range(first, len(names)):
        # every rank starts method i together: a rank that left method i early (its failure) must
        # not run ahead into i+1's rendezvous while the others still wait out i
        key, deadline = f"{attempt}/{i}/start", time.monotonic() + 600
        store.add(key, 1)
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
        tmp = os.path.join(base, f"{attempt}_{i}")
        conn.send((i, *_run_one(names[i], rank, world, store, f"{attempt}/{i}/", tmp)))
    conn.close()


def run(algorithm: str, world_size: int, names: list[str], timeout: float = TEST_TIMEOUT) -> dict:
    """Run ``names`` on ``world_size`` rank processes with distrain.comm bound to ``algorithm``.

    A method passes when it passes on every rank; one that does not finish on every rank within
    ``timeout`` seconds is a hang ("timeout"): the ranks are ended and restarted at the next method.
    """
    import multiprocessing as mp
    from datetime import timedelta

    os.environ[ENV_ALG] = algorithm  # the spawned ranks bind their shim from it at import
    os.environ["WORLD_SIZE"] = str(world_size)
    ctx = mp.get_context("spawn")
    rows: dict[str, str] = {}
    detail: dict[str, str] = {}
    t0 = time.monotonic()
    attempt, first = 0, 0
    with tempfile.TemporaryDirectory(prefix="distrain-conf-") as base:
        store = _torch_dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                                     timeout=timedelta(seconds=PG_TIMEOUT))
        while first < len(names):
            pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
            procs = [ctx.Process(target=_rank_main, args=(r, world_size, store.port, names, first, attempt, base,
                                                          pipes[r][1]), daemon=True) for r in range(world_size)]
            for p in procs:
                p.start()
            for _, w in pipes:
                w.close()
            got: dict[int, list] = {}
            i, deadline = first, time.monotonic() + timeout + 120  # + start-up (imports) of the ranks
            while i < len(names):
                for r, (rd, _) in enumerate(pipes):
                    if r not in got.get(i, {}) and rd.poll(0.05):
                        try:
                            j, outcome, text = rd.recv()
                        except EOFError:
                            continue
                        got.setdefault(j, {})[r] = (outcome, text)
                if len(got.get(i, {})) == world_size:
                    res = got.pop(i)
                    kinds = {o for o, _ in res.values()}
                    rows[names[i]] = next((k for k in ("infra", "fail", "skip") if k in kinds), "pass")
                    texts = [f"rank {r}: {t}" for r, (o, t) in sorted(res.items()) if o != "pass"]
                    if texts:
                        detail[names[i]] = "\n".join(texts)
                    i, deadline = i + 1, time.monotonic() + timeout
                elif time.monotonic() > deadline or not any(p.is_alive() for p in procs) and \
                        not any(rd.poll() for rd, _ in pipes):
                    rows[names[i]] = "timeout"
                    detail[names[i]] = f"not finished on ranks {sorted(set(range(world_size)) - set(got.get(i, {})))}"
                    i += 1
                    break
            for p in procs:
                p.kill() if p.is_alive() else None
                p.join(5)
            first, attempt = i, attempt + 1
    return {"rows": rows, "detail": detail, "seconds": round(time.monotonic() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--algorithm", default="all",
                    help="native, star, ring, tree, comma-separated, or all; 'torch' runs torch.distributed itself "
                         "(the baseline: methods that fail there fail for reasons of this runner or machine)")
    ap.add_argument("--world-size", default="2,3,4", help="comma-separated world sizes (default 2,3,4)")
    ap.add_argument("-k", action="append", help="run only methods whose name contains this (repeatable)")
    ap.add_argument("--json", help="write every method's outcome here")
    ap.add_argument("--timeout", type=float, default=TEST_TIMEOUT, help="seconds per method before it counts as a hang")
    ap.add_argument("-v", action="store_true", help="print each failure's traceback tail")
    ap.add_argument("--list", action="store_true", help="list the selected methods and exit")
    a = ap.parse_args(argv)
    names = selected(a.k)
    if a.list:
        print("\n".join(names))
        return 0
    algs = ALGORITHMS if a.algorithm == "all" else tuple(a.algorithm.split(","))
    bad_alg = [x for x in algs if x not in ALGORITHMS + (BASELINE,)]
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
            c = {k: sum(v == k for v in got["rows"].values()) for k in ("pass", "fail", "skip", "timeout", "infra")}
            failed += c["fail"] + c["timeout"]
            print(f"{alg:6s} P={ws}: {c['pass']:3d} passed, {c['fail']:3d} failed, {c['skip']:3d} skipped, "
                  f"{c['timeout']} timed out" + (f", {c['infra']} not run (process group did not start)"
                                                 if c["infra"] else "") + f"  ({got['seconds']:.0f} s)",
                  flush=True)
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
