"""`distrain launch` runs a script on many ranks through torchrun, single- and multi-node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys, torch, distrain
    from distrain import comm
    info = distrain.runtime.init(timeout=60)
    if len(sys.argv) > 2 and sys.argv[2] == "fail" and info.rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    t = torch.full((5,), float(info.rank))
    comm.all_reduce(t, algorithm="ring")
    with open(f"{sys.argv[1]}/rank{info.rank}.txt", "w") as f:
        f.write(f"{info.rank} {info.world_size} {info.local_rank} {t[0].item()}")
    distrain.runtime.shutdown()
""")


def _launch(*args: str, timeout: float = 120) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return subprocess.Popen([sys.executable, "-m", "distrain.cli", "launch", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"launch hung:\n{out}")
    return p.returncode, out


@pytest.mark.timeout(150)
def test_launch_single_node(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    code, out = _finish(_launch("--nproc-per-node", "3", str(script), str(tmp_path)))
    assert code == 0, out
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(3))
    # rank, world size, local rank, and the ring all-reduce of the ranks: 0+1+2
    assert lines == ["0 3 0 3.0", "1 3 1 3.0", "2 3 2 3.0"]


@pytest.mark.timeout(150)
def test_launch_two_nodes_rendezvous(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    nodes = [_launch(*common, "--node-rank", str(n), str(script), str(tmp_path)) for n in range(2)]
    results = [_finish(p) for p in nodes]
    for code, out in results:
        assert code == 0, out
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    # each node has one process: local rank 0 on both, global ranks 0 and 1
    assert lines == ["0 2 0 1.0", "1 2 0 1.0"]


@pytest.mark.timeout(150)
def test_launch_failing_rank_fails_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    code, out = _finish(_launch("--nproc-per-node", "2", str(script), str(tmp_path), "fail"))
    assert code != 0
    assert "rank 1 fails on purpose" in out


def test_launch_needs_endpoint_for_many_nodes(tmp_path):
    code, out = _finish(_launch("--nnodes", "2", "--nproc-per-node", "1", "x.py"))
    assert code == 2 and "--nnodes=2 needs --rdzv-endpoint HOST:PORT" in out


# -- core binding -------------------------------------------------------------------------

def test_core_slices_are_disjoint_and_refuse_too_few_cores():
    from distrain.launch import core_slices
    assert core_slices(2, [0, 1, 2, 3, 4]) == [[0, 1], [2, 3]]  # 5 // 2 = 2 cores each, one left over
    assert core_slices(3, [4, 0, 2]) == [[0], [2], [4]]
    assert core_slices(3, [0, 1]) is None  # fewer cores than ranks: the kernel places them


def _affinity(rank):
    import torch
    return sorted(os.sched_getaffinity(0)), torch.get_num_threads()


@pytest.mark.timeout(120)
def test_spawn_binds_each_rank_to_its_own_cores():
    import distrain
    from distrain.errors import ConfigError
    from distrain.launch import core_slices
    slices = core_slices(2)
    if slices is None:
        pytest.skip("one core: ranks cannot be bound to cores of their own")
    assert distrain.spawn(_affinity, 2, timeout=90, bind_cores=True) == [(s, len(s)) for s in slices]
    # by default only a job whose transport polls shared memory is bound; Gloo's is left free
    shm_job = distrain.spawn(_affinity, 2, timeout=90, env={"DISTRAIN_TRANSPORT": "shm"})
    assert shm_job == [(s, len(s)) for s in slices]
    free = distrain.spawn(_affinity, 2, timeout=90, env={"DISTRAIN_TRANSPORT": "torch"})
    assert all(cores == sorted(os.sched_getaffinity(0)) for cores, _ in free)
    with pytest.raises(ConfigError, match="bind_cores=True needs a core per rank"):
        distrain.spawn(_affinity, len(os.sched_getaffinity(0)) + 1, bind_cores=True)
