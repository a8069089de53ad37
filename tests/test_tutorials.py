"""Tutorial-style scripts (tests/tutorials/, written on the seeds' and PyTorch's tutorial examples)
run once with torch.distributed and once per algorithm with distrain.comm in its place: the
results must be equal (floats: fp64 to 1e-12, the algorithms sum in a different order).

Each script is run as its own program would be under torchrun: it calls
``dist.init_process_group("gloo")`` itself (``distrain.spawn(..., init=False)``) and gets a
fresh rendezvous store, so it can destroy and the next script re-create the process group.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
import time
from datetime import timedelta

import pytest

import distrain

TUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tutorials")
SCRIPTS = ("p2p.py", "collectives.py", "groups.py", "ddp_toy.py")
ALGS = ("native", "star", "ring", "tree")


def _run_scripts(rank: int, impl: str, algorithm: str, scripts: tuple[str, ...]) -> dict:
    import torch
    import torch.distributed as dist

    os.environ.update(TUTORIAL_DIST=impl, TUTORIAL_ALGORITHM=algorithm)
    sys.path.insert(0, TUT_DIR)
    world = int(os.environ["WORLD_SIZE"])
    parent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                           timeout=timedelta(seconds=120))
    out = {}
    for name in scripts:
        # a fresh store per script, hosted by rank 0, announced through the parent's store
        own = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
        if own is not None:
            parent.set(f"tutorial/{impl}/{algorithm}/{name}", str(own.port))
        port = parent.get(f"tutorial/{impl}/{algorithm}/{name}").decode()
        env = {"MASTER_PORT": port, "TORCHELASTIC_USE_AGENT_STORE": "True"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            out[name] = runpy.run_path(os.path.join(TUT_DIR, name), run_name="__main__")["RESULT"]
        finally:
            torch.set_default_dtype(torch.float32)
            os.environ.update({k: v for k, v in saved.items() if v is not None})
        done = f"tutorial/{impl}/{algorithm}/{name}/done"
        parent.add(done, 1)
        while parent.add(done, 0) < world:  # rank 0 keeps its store until every rank is done
            time.sleep(0.01)
    return out


def _diff(a, b, path: str = "") -> list[str]:
    if isinstance(a, float) and isinstance(b, float):
        return [] if math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) else [f"{path}: {a} != {b}"]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for k in a for d in _diff(a[k], b[k], f"{path}.{k}")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


@pytest.fixture(scope="module")
def torch_results():
    return distrain.spawn(_run_scripts, 3, args=("torch", "native", SCRIPTS), init=False, timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("algorithm", ALGS)
def test_tutorials_equal_torch(torch_results, algorithm):
    ours = distrain.spawn(_run_scripts, 3, args=("distrain", algorithm, SCRIPTS), init=False, timeout=240)
    bad = [f"rank {r} {d}" for r in range(3) for d in _diff(torch_results[r], ours[r])]
    assert not bad, "\n".join(bad[:20])
    # the scripts did what the tutorials say (not just the same as torch)
    r0 = ours[0]
    assert r0["collectives.py"]["all_reduce"] == [[3.0, 3.0], [3.0, 3.0]]
    assert r0["p2p.py"]["any_source"] == [(1, 10.0), (2, 20.0)]
    assert ours[1]["groups.py"]["all_reduce_evens"] == [2.0, 2.0, 2.0]  # rank 1 is not in evens: untouched
    assert r0["groups.py"]["all_reduce_evens"] == [4.0, 4.0, 4.0]
    assert all(not _diff(ours[r]["ddp_toy.py"], r0["ddp_toy.py"]) for r in range(3))  # ranks agree
