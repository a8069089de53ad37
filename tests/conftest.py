"""Shared test helpers: spawning ranks, the single-process reference run, and the two tiers.

Tiers: ``pytest -m "not slow" -n 2`` is the fast tier (under two minutes on 2 cores); ``make test`` runs
everything. A test is slow when it is marked ``@pytest.mark.slow`` or when its own
``@pytest.mark.timeout`` allows two minutes or more (the timeout already says "this one
is long"), so a new long test lands in the slow tier without anyone remembering to mark it;
a few long tests of other areas are listed by name in SLOW_TESTS.

Helpers:
    run_ranks(fn, nprocs, *args, timeout=90)   distrain.spawn with every rank's problems
                                               checked: fn returns a list of failure strings
    train_losses(cfg)                          train with distrain's trainer, return the losses
    reference_losses(tmp_path_factory, **kw)   the single-process run of the same job (cached
                                               per session: many equivalence tests share it)
"""

from __future__ import annotations

import os

import pytest

SLOW_TIMEOUT_S = 120
# long tests in other areas' files, named here so their files need no edit
SLOW_TESTS = {"test_gpt_learns_tiny_repeated_text", "test_generate",
              "test_gpt_tp4_native_equals_one_process",
              "test_ledger_all_reduces_per_step_are_exactly_megatrons", "test_gpt_tp2_ring_tree_star_equals_one_process"}


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a long test (multi-process training jobs); skipped by -m 'not slow'")
    config.addinivalue_line("markers", "faults_long: randomized fault-injection trials; run only with -m faults_long")
    # One torch thread per process: make test runs two test processes (xdist) on 2 cores beside the ranks
    # they spawn, and torch's default (a thread per core) then oversubscribes the cores; its OpenMP threads
    # spin-wait on each other, so a tiny model's 30 AdamW steps took 11-27 s instead of 1 s here and a
    # one-process 300-step mlp-tiny run 30 s instead of 5 s (measured under load). This process sets its own;
    # OMP_NUM_THREADS reaches the ranks (spawn's default_threads) and CLI subprocesses (torch reads it).
    # Tests of the thread defaults unset it; those that measure throughput set their threads themselves.
    # (Here, not at import: a spawned rank imports this file too.)
    import torch
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if "faults_long" not in (config.getoption("markexpr") or ""):  # long fault trials: only when asked for
        keep = [i for i in items if i.get_closest_marker("faults_long") is None]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    for item in items:
        t = item.get_closest_marker("timeout")
        long_timeout = t is not None and t.args and t.args[0] >= SLOW_TIMEOUT_S
        if (long_timeout or item.originalname in SLOW_TESTS) and item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.slow)


def expect_error(fn, exc, *fragments) -> str:
    """Run fn, return '' if it raised exc with every fragment in the message, else a complaint.
    (Ranks collect complaints and the test asserts the list is empty, so one run reports all.)"""
    try:
        fn()
    except exc as e:
        missing = [f for f in fragments if f not in str(e)]
        return f"message lacks {missing}: {e}" if missing else ""
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__} instead of {exc.__name__}: {e}"
    return f"did not raise {exc.__name__}"


def run_ranks(fn, nprocs: int, *args, timeout: float = 90, env: dict | None = None) -> list:
    """Run ``fn(rank, *args)`` on ``nprocs`` ranks (``env``: set in theirs); each returns a list of
    problems (strings; an empty one is none).

    Fails naming every rank's problems (the first 40 of them, and how many), so one run reports them
    at once."""
    import distrain

    results = distrain.spawn(fn, nprocs, args=args, timeout=timeout, env=env)
    bad = [f"rank {r}: {p}" for r, res in enumerate(results) for p in (res or []) if p]
    assert not bad, f"{len(bad)} problem(s):\n" + "\n".join(bad[:40])
    return results


def one_process_losses(model, opt, loss_fn, batches) -> list[float]:
    """The single-process reference: per (x, y) of ``batches``, zero_grad, forward, loss,
    backward, optimizer step; returns the losses."""
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_losses(cfg) -> list[float]:
    """Train ``cfg`` (a TrainConfig) and return the logged losses, one per step."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_metrics

    train(cfg)
    return [r["loss"] for r in read_metrics(os.path.join(cfg.out, "metrics.jsonl"))]


# trainer_config's job (with out=)
TRAINER_BASE = dict(model="gpt-tiny", data="shakespeare", steps=5, batch_size=12, lr=1e-2, dtype="float64",
                    eval_every=0, sample_chars=0, progress=False, log_every=2, timeout=120)


def trainer_config(out, **kw):
    """A small, exact trainer job: gpt-tiny in fp64, 5 steps, no evaluation, no output noise."""
    from distrain.trainer import TrainConfig

    return TrainConfig(**{**TRAINER_BASE, "out": str(out), **kw})


def _job_key(kw: dict) -> tuple:
    """``kw`` of trainer_config without what only repeats its defaults (model="gpt-tiny" is the same job)."""
    return tuple(sorted((k, v) for k, v in kw.items() if not (k in TRAINER_BASE and TRAINER_BASE[k] == v)))


def once_per_session(tmp_path_factory, kind: str, key: tuple, compute):
    """``compute()`` (a JSON value: floats come back exactly), once per test session: under pytest-xdist the
    first worker that needs it writes it into the session's folder that the workers share (basetemp's
    parent; a lock per value while it is computed) and the others read it; without xdist it just runs."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return compute()
    import fcntl
    import hashlib
    import json

    name = hashlib.sha256(repr((kind, key)).encode()).hexdigest()[:20]
    shared = tmp_path_factory.getbasetemp().parent / f"shared-{kind}-{name}.json"
    with open(f"{shared}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if shared.exists():
            return json.loads(shared.read_text())
        value = compute()
        part = shared.with_suffix(".part")
        part.write_text(json.dumps(value))
        os.replace(part, shared)
        return value


def train_rows(cfg) -> list[dict]:
    """Train ``cfg`` and return every line of its metrics.jsonl (steps, evaluations, counters)."""
    from distrain.trainer import train
    from distrain.trainer.metrics import read_metrics

    train(cfg)
    return read_metrics(os.path.join(cfg.out, "metrics.jsonl"))


# 4 steps with evaluations after steps 2 and 4 (logged as steps 1 and 3): the layouts' equivalence runs
EVAL = dict(steps=4, eval_every=2, eval_batches=2, log_every=1)
_REFERENCE_ROWS: dict = {}


def reference_rows(tmp_path_factory, **kw) -> list[dict]:
    """The metrics lines of the single-process run of ``trainer_config(**EVAL, **kw)``, once per session."""
    key = _job_key(kw)
    if key not in _REFERENCE_ROWS:
        def compute():
            out = tmp_path_factory.mktemp("reference-rows")
            return train_rows(trainer_config(out, **EVAL, **kw, strategy="single", nproc=1))

        _REFERENCE_ROWS[key] = once_per_session(tmp_path_factory, "reference-rows", key, compute)
    return _REFERENCE_ROWS[key]


def assert_rows_equal(got: list[dict], ref: list[dict], rel: float = 1e-10) -> None:
    """An ``EVAL`` run's steps 0-3 and its evaluations at steps 1 and 3 equal the reference's: the
    training loss and the validation loss within ``rel``."""
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [0, 1, 2, 3]
    assert [r["step"] for r in got if "val_loss" in r] == [r["step"] for r in ref if "val_loss" in r] == [1, 3]
    for g, r in zip(got, ref):
        assert g["loss"] == pytest.approx(r["loss"], rel=rel, abs=0), f"training loss at step {g['step']}"
        if "val_loss" in r:
            assert g["val_loss"] == pytest.approx(r["val_loss"], rel=rel, abs=0), f"val_loss at step {g['step']}"


def assert_refused(cfg, message: str | None) -> None:
    """``cfg.validate()`` passes (``message`` None) or raises a one-line ConfigError containing ``message``."""
    from distrain.errors import ConfigError

    if message is None:
        cfg.validate()
        return
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert message in str(e.value) and "\n" not in str(e.value)


_REFERENCES: dict = {}


def process_tree() -> dict[int, list[int]]:
    """{parent pid: its children's pids}, from /proc now."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    return children


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, their children, ...), from /proc now."""
    children = process_tree()
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def consolidated_state(out) -> dict:
    """A run folder's committed checkpoint as {"model": whole-model tensors, "optimizer": per-parameter state}
    (checkpoint/reshard.py consolidate: whatever layout wrote it)."""
    from distrain.checkpoint.reshard import consolidate

    f = consolidate(out)
    return {"model": f["model"], "optimizer": f["optimizer"]["state"]}


def state_differences(a: dict, b: dict) -> list[str]:
    """The names whose tensors are not bit for bit equal in two ``consolidated_state`` results (model, then
    every optimizer state tensor); the same names and state keys on both sides are asserted."""
    import torch

    assert a["model"].keys() == b["model"].keys()
    bad = [n for n in a["model"] if not torch.equal(a["model"][n], b["model"][n])]
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for n, st in a["optimizer"].items():
        assert st.keys() == b["optimizer"][n].keys()
        for k, v in st.items():
            if torch.is_tensor(v) and not torch.equal(v, b["optimizer"][n][k]):
                bad.append(f"optimizer {n} {k}")
    return bad


def assert_bitwise(out, losses: list[float], ref, steps: int | None = None) -> None:
    """Every step's loss ``==`` and run folder ``out``'s final state bit for bit those of ``ref`` = (losses,
    consolidated_state) of the reference run (``steps``: how many losses there must be)."""
    want_losses, want_state = ref
    assert len(losses) == len(want_losses) and (steps is None or len(losses) == steps)
    wrong = [(i, a, b) for i, (a, b) in enumerate(zip(losses, want_losses)) if a != b]
    assert not wrong, f"{len(wrong)} step losses differ, first {wrong[:3]}"
    assert state_differences(consolidated_state(out), want_state) == []


def invariant_matrix(full: dict, suite: list[str]) -> list[str]:
    """The layouts a --layout-invariant matrix test runs: ``suite`` (each kind of layout at least once) in
    `make test`, to stay in its time budget; every one of ``full`` with DISTRAIN_INVARIANT_MATRIX=all."""
    assert set(suite) <= set(full)
    return list(full) if os.environ.get("DISTRAIN_INVARIANT_MATRIX") == "all" else suite


def reference_losses(tmp_path_factory, **kw) -> list[float]:
    """The single-process run of ``trainer_config(**kw)``, computed once per session."""
    key = _job_key(kw)
    if key not in _REFERENCES:
        def compute():
            out = tmp_path_factory.mktemp("reference")
            return train_losses(trainer_config(out, **kw, strategy="single", nproc=1))

        _REFERENCES[key] = once_per_session(tmp_path_factory, "reference", key, compute)
    return _REFERENCES[key]


# -- ranks without a launcher (a rank may SIGKILL itself; nothing restarts or blames it) ------------
def raw_ranks(target, world: int, out_dir, kernels: str) -> list:
    """``target(rank, port, world, out_dir, kernels)`` in ``world`` processes of multiprocessing's
    spawn around a fresh TCPStore on 127.0.0.1; returns them joined (90 s each)."""
    import multiprocessing as mp
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=60),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, store.port, world, str(out_dir), kernels)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
    return procs


def init_raw_rank(rank: int, port: int, world: int, kernels: str) -> None:
    """In a :func:`raw_ranks` process: join the world over the shared-memory transport with ``kernels``."""
    import torch

    from distrain import runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      DISTRAIN_TRANSPORT="shm", DISTRAIN_SHM_KERNELS=kernels, TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(1)
    runtime.init("gloo", timeout=60)


def shm_files_of(procs) -> list[str]:
    """The /dev/shm files created by any of ``procs`` that are still there."""
    from distrain.comm.shm import segment

    pids = {str(p.pid) for p in procs}
    return [n for n in os.listdir(segment.SHM_DIR) if n.startswith("distrain-") and n.split("-")[1] in pids]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (bound and released)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on; "0.0.0.0" / "::" is every interface."""
    import socket
    from pathlib import Path

    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host-endian
            found.append((socket.inet_ntop(family, raw), int(hexport, 16)))
    return found
