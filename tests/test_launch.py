"""`distrain launch` runs a script on many ranks through torchrun, single- and multi-node."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import free_port

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


def _launch(*args: str, timeout: float = 120, secret: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTRAIN_JOB_SECRET")}
    if secret is not None:
        env["DISTRAIN_JOB_SECRET"] = secret
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
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    secret = "7" * 64  # every node of one job: the same secret (distrain.sealed)
    nodes = [_launch(*common, "--node-rank", str(n), str(script), str(tmp_path), secret=secret) for n in range(2)]
    results = [_finish(p) for p in nodes]
    for code, out in results:
        assert code == 0, out
    lines = sorted((tmp_path / f"rank{r}.txt").read_text() for r in range(2))
    # each node has one process: local rank 0 on both, global ranks 0 and 1
    assert lines == ["0 2 0 1.0", "1 2 0 1.0"]


@pytest.mark.timeout(150)
def test_launch_two_nodes_needs_one_secret(tmp_path):
    """Without DISTRAIN_JOB_SECRET a multi-node launch is refused in one line before anything starts; a node
    with another secret cannot read the rendezvous state (its tag does not match) and fails, unpickling nothing."""
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    port = free_port()
    common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    code, out = _finish(_launch(*common, "--node-rank", "0", str(script), str(tmp_path)))
    assert (code, out) == (2, "distrain: error: launch: a job over several nodes needs a shared secret, so that nobody "
                              "else on the network can join or read its stores: set DISTRAIN_JOB_SECRET to the same "
                              "value on every node (make one with `distrain secret`)\n")
    host = _launch(*common, "--node-rank", "0", str(script), str(tmp_path), secret="a" * 64)
    deadline = time.monotonic() + 60
    while True:  # node 0 hosts the rendezvous store (and writes the state) before node 1 comes
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and host.poll() is None, "node 0 never listened"
            time.sleep(0.1)
    try:
        code, out = _finish(_launch(*common, "--node-rank", "1", str(script), str(tmp_path), secret="b" * 64))
    finally:
        host.kill()
        first = host.communicate()[0]
    # whichever node reads the other's state refuses it (node 1 fails either way: it reads node 0's state, or
    # loses node 0's store when node 0 refused node 1's)
    assert code != 0 and "the rendezvous state in the store is not tagged with this job's secret" in out + first, \
        out + first
    assert not list(tmp_path.glob("rank*.txt"))


@pytest.mark.timeout(150)
def test_launch_failing_rank_fails_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    code, out = _finish(_launch("--nproc-per-node", "2", str(script), str(tmp_path), "fail"))
    assert code != 0
    assert "rank 1 fails on purpose" in out


def test_launch_needs_endpoint_for_many_nodes(capsys):
    # refused before torchrun or any rank: the command's entry (cli.main) in this process, no fresh interpreter
    from distrain.cli import main

    code = main(["launch", "--nnodes", "2", "--nproc-per-node", "1", "x.py"])
    out = "".join(capsys.readouterr())
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


@pytest.mark.timeout(100)
def test_unbound_ranks_take_omp_num_threads_when_set_else_cores_per_rank(monkeypatch):
    import distrain
    from distrain.errors import ConfigError

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [t for _, t in distrain.spawn(_affinity, 1, timeout=90, bind_cores=False)] == [1]
    monkeypatch.delenv("OMP_NUM_THREADS")
    want = max(1, (os.cpu_count() or 1) // 1)
    assert [t for _, t in distrain.spawn(_affinity, 1, timeout=90, bind_cores=False)] == [want]
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ConfigError, match=r"^OMP_NUM_THREADS='two' is not a positive whole number of threads"):
        distrain.spawn(_affinity, 1, timeout=90, bind_cores=False)


@pytest.mark.timeout(120)
def test_spawn_binds_each_rank_to_its_own_cores():
    import distrain
    from distrain.launch import core_slices
    slices = core_slices(2)
    if slices is None:
        pytest.skip("one core: ranks cannot be bound to cores of their own")
    assert distrain.spawn(_affinity, 2, timeout=90, bind_cores=True) == [(s, len(s)) for s in slices]
    assert distrain.spawn(_affinity, 2, timeout=90, bind_cores=False)[0][0] == sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(120)
def test_shm_jobs_are_bound_only_to_free_cores(monkeypatch):
    """The default binds a job whose transport polls shared memory when P cores are free, to the
    freest; with the cores busy it leaves the ranks to the scheduler (launch/cores.py)."""
    import distrain
    from distrain.launch import cores, local

    assert cores.free_core_slices(2, {0: 0.9, 1: 0.2, 2: 0.8, 3: 0.95}) == [[0], [3]]
    assert cores.free_core_slices(2, {0: 0.9, 1: 0.2, 2: 0.4, 3: 0.3}) is None  # one free core for two ranks
    assert cores.free_core_slices(1, {0: 0.6, 1: 0.2, 2: 0.99}) == [[0, 2]]  # one rank: every free core
    assert cores.free_core_slices(2, {}) is None  # no /proc/stat: unbound
    idle = cores.idle_fractions(0.02)
    assert set(idle) == set(os.sched_getaffinity(0)) and all(0.0 <= f <= 1.0 for f in idle.values())
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        pytest.skip("one core: ranks cannot be bound to cores of their own")
    monkeypatch.setattr(local, "free_core_slices", lambda n: cores.free_core_slices(n, dict.fromkeys(usable, 1.0)))
    assert distrain.spawn(_affinity, 2, timeout=90, env={"DISTRAIN_TRANSPORT": "shm"}) == \
        [(s, len(s)) for s in cores.core_slices(2)]
    monkeypatch.setattr(local, "free_core_slices", lambda n: cores.free_core_slices(n, dict.fromkeys(usable, 0.1)))
    busy = distrain.spawn(_affinity, 2, timeout=90, env={"DISTRAIN_TRANSPORT": "shm"})
    assert all(c == usable for c, _ in busy)


@pytest.mark.timeout(120)
def test_gloo_jobs_are_left_unbound():
    import distrain
    from distrain.errors import ConfigError
    free = distrain.spawn(_affinity, 2, timeout=90, env={"DISTRAIN_TRANSPORT": "torch"})
    assert all(cores == sorted(os.sched_getaffinity(0)) for cores, _ in free)
    with pytest.raises(ConfigError, match="bind_cores=True needs a core per rank"):
        distrain.spawn(_affinity, len(os.sched_getaffinity(0)) + 1, bind_cores=True)


EXIT_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time, torch, torch.distributed as dist
    from distrain import runtime

    def after_runtime():  # registered before init, so it runs after init's exit hook (atexit: last in, first out)
        alive = sorted(t.name for t in threading.enumerate() if t.name == "distrain-watchdog")
        print(f"AT EXIT rank {rank}: initialized={dist.is_initialized()} watchdog={alive}", flush=True)

    atexit.register(after_runtime)
    runtime.init("gloo", timeout=30)
    rank = dist.get_rank()
    t = torch.full((5,), float(rank + 1))
    dist.all_reduce(t)
    # rank 0 leaves an async all_gather in flight and exits; the others join it 1 s later, while rank 0 exits
    if rank > 0:
        time.sleep(1.0)
    outs = [torch.empty(2) for _ in range(dist.get_world_size())]
    work = dist.all_gather(outs, torch.full((2,), float(rank)), async_op=True)
    if rank > 0:
        work.wait()
        print(f"GATHERED rank {rank}: {[o[0].item() for o in outs]}", flush=True)
    del outs, work  # Gloo's worker thread now holds the last references to the tensors
    print(f"SUM rank {rank}: {t[0].item()}", flush=True)
""")


@pytest.mark.timeout(120)
def test_a_launched_rank_exits_with_its_process_group_destroyed_before_finalization(tmp_path):
    """A rank started by a launcher ends through interpreter exit; runtime.init's exit hook must
    destroy the group (joining Gloo's threads) and stop the watchdog before finalization, else a
    C++ thread taking the GIL then aborts the rank (SIGABRT, "terminate called without an active
    exception"), as it did under torchrun once per few suite runs."""
    from distrain.launch import local_store

    world = 3
    store = local_store(world, 60)  # the test plays the launcher, which hosts the store (as torchrun's agent does)
    script = tmp_path / "rank.py"
    script.write_text(EXIT_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("DISTRAIN_PARENT_PID", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo",
               TORCHELASTIC_USE_AGENT_STORE="True",
               PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src") + os.pathsep + env.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, str(script)], env=env | {"RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung at exit")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}"
        assert f"SUM rank {r}: 6.0" in out, out
        assert f"AT EXIT rank {r}: initialized=False watchdog=[]" in out, out
        assert "terminate called" not in out, out
        if r > 0:
            assert f"GATHERED rank {r}: [0.0, 1.0, 2.0]" in out, out


@pytest.mark.timeout(150)
def test_launched_train_ranks_leave_through_runtime_leave_with_complete_outputs(tmp_path):
    """`python -m distrain.cli train` as launched ranks ends through runtime.leave (atexit callbacks, flushed
    stdio, os._exit: no interpreter finalization); the run's files are complete and the status is 0."""
    from distrain.launch import local_store
    from distrain.trainer.metrics import read_metrics

    world = 3
    store = local_store(world, 60)
    env = {k: v for k, v in os.environ.items() if k not in ("DISTRAIN_PARENT_PID", "LOCAL_RANK", "DISTRAIN_RESUME")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo",
               TORCHELASTIC_USE_AGENT_STORE="True",
               PYTHONPATH=os.path.join(os.path.dirname(__file__), "..", "src") + os.pathsep + env.get("PYTHONPATH", ""))
    args = ["train", "--nproc", str(world), "--model", "mlp-tiny", "--data", "digits", "--steps", "5", "--batch-size",
            "15", "--eval-every", "0", "--no-progress", "--no-report", "--out", str(tmp_path / "run")]
    procs = [subprocess.Popen([sys.executable, "-m", "distrain.cli", *args], env=env | {"RANK": str(r)}, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    outs = [_finish(p, 120)[1] for p in procs]
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{out}"
        assert "terminate called" not in out, out
    assert [m["step"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [0, 1, 2, 3, 4]
    assert (tmp_path / "run" / "summary.json").exists()


def test_exit_status_is_the_interpreters():
    from distrain.cli import exit_status

    assert exit_status(lambda: 3) == 3
    assert exit_status(lambda: None) == 0
    assert exit_status(lambda: sys.exit(2)) == 2
    assert exit_status(lambda: sys.exit()) == 0

    def boom():
        raise RuntimeError("x")

    assert exit_status(boom) == 1


def test_the_fork_servers_exit_handler_ends_only_the_fork_server():
    """launch.warm's handler skips the fork server's finalization; a rank forked from the server inherits it
    and may run the exit handlers itself (runtime.leave): there it must leave the rank's exit status alone."""
    import os

    from distrain.launch import warm

    pid = os.fork()
    if pid == 0:  # a process other than the "server" runs the handler: nothing happens, its own status stays
        warm._end_now(server=os.getppid())
        os._exit(7)
    assert os.waitpid(pid, 0)[1] >> 8 == 7
    pid = os.fork()
    if pid == 0:  # the server itself: ends at once, with status 0
        warm._end_now(server=os.getpid())
        os._exit(7)
    assert os.waitpid(pid, 0)[1] >> 8 == 0
