"""The process's environment is read at its edge (cli, launch, runtime) and passed down.

"Am I a launched rank?" has one answer, :func:`distrain.runtime.launched_rank` (RANK and WORLD_SIZE
from an explicit mapping, default the process's); :meth:`TrainConfig.validate` takes what it needs of
the environment as parameters (``runtime.validate_args``), so the same config validates the same way
whatever the environment of the process that checks it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from distrain import runtime
from distrain.errors import ConfigError
from distrain.trainer import TrainConfig

SRC = Path(__file__).resolve().parents[1] / "src" / "distrain"


def test_launched_rank_reads_rank_and_world_size_from_the_mapping_it_is_given():
    assert runtime.launched_rank({}) is None
    assert runtime.launched_rank({"RANK": "1"}) is None  # both or neither: a launcher sets both
    assert runtime.launched_rank({"WORLD_SIZE": "4"}) is None
    assert runtime.launched_rank({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == (3, 4)
    with pytest.raises(ConfigError, match=r"^environment variable RANK='x' is not an integer$"):
        runtime.launched_rank({"RANK": "x", "WORLD_SIZE": "4"})
    assert runtime.validate_args({"RANK": "0", "WORLD_SIZE": "2", "DISTRAIN_FASHION_MNIST": "/data/fm"}) == \
        {"launched": (0, 2), "fashion_mnist_root": "/data/fm"}
    assert runtime.validate_args({}) == {"launched": None, "fashion_mnist_root": None}


def test_no_module_asks_the_environment_whether_it_is_a_launched_rank():
    """Only runtime.py reads RANK or WORLD_SIZE from os.environ; everyone else calls launched_rank."""
    asks = re.compile(r"""os\.environ(\.get\(|\[)\s*["'](RANK|WORLD_SIZE)["']|["'](RANK|WORLD_SIZE)["']\s+(not\s+)?in\s+"""
                      r"""os\.environ""")
    found = [f"{p.relative_to(SRC)}:{i}: {line.strip()}" for p in sorted(SRC.rglob("*.py")) if p.name != "runtime.py"
             for i, line in enumerate(p.read_text().splitlines(), 1) if asks.search(line)]
    assert found == []
    assert asks.search('if "RANK" in os.environ and "WORLD_SIZE" in os.environ:')  # (the pattern sees the old form)
    assert asks.search('int(os.environ.get("RANK", "0"))') and asks.search('os.environ["WORLD_SIZE"]')


def test_validate_takes_the_environment_as_parameters(tmp_path, monkeypatch):
    """The local-rank limit and the Fashion-MNIST folder come from the parameters, not the environment."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "100000")
    monkeypatch.setenv("DISTRAIN_FASHION_MNIST", str(tmp_path))
    many = TrainConfig(model="mlp-tiny", data="digits", nproc=100000, batch_size=100000)
    with pytest.raises(ConfigError, match=r"^--nproc 100000: a local job runs at most \d+ ranks here"):
        many.validate()  # the environment says launched; nothing passed down says so
    many.validate(launched=(0, 100000))
    fm = TrainConfig(model="mlp", data="fashion-mnist", strategy="single", nproc=1)
    fm.validate(fashion_mnist_root=str(tmp_path))
    with pytest.raises(ConfigError, match=r"^--data fashion-mnist: data set not found; "):
        fm.validate(fashion_mnist_root=str(tmp_path / "absent"))
    fm.validate(**runtime.validate_args())  # what the CLI and train() pass: $DISTRAIN_FASHION_MNIST


# Where a process starts, outside cli/, launch/ and runtime.py: each reads what its launcher put in the
# environment, once, at its start, and passes it down (module -> why it is a process's edge).
PROCESS_STARTS = {
    "comm/compat.py": "init_process_group, torch's counterpart for a user's script, reads comm's switches",
    "elastic/member.py": "Member.from_env: an elastic rank's start (the coordinator's address, its id)",
    "elastic/nodes.py": "a node agent's start (the node list and the job secret)",
    "elastic/faults.py": "the fault plan a test injects, read once as a rank starts",
    "elastic/ranks.py": "hands the fault plan on to the ranks it forks",
    "rendezvous.py": "torchrun's rendezvous handler, which torch builds inside the launched process",
    "lifeline.py": "a rank's parent, read as the rank starts",
    "cluster/runner.py": "an emulated node's start (passes the caller's environment to it)",
    "cluster/command.py": "the command an emulated node runs, read as it starts",
    "bench/": "each benchmark is a command's process (its ranks' launch environment)",
}


def test_the_environment_is_read_only_where_a_process_starts():
    """os.environ / os.getenv appear only in cli/, launch/, runtime.py and the process starts listed (each with
    its reason); a library module below them takes what it needs as a parameter."""
    reads = re.compile(r"os\.environ|os\.getenv")
    found = sorted({str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if reads.search(p.read_text())})
    edge = ("cli/", "launch/", "runtime.py")
    below = [f for f in found if not f.startswith(edge) and not any(f == s or (s.endswith("/") and f.startswith(s))
                                                                     for s in PROCESS_STARTS)]
    assert below == [], f"environment read below the process edge (pass the value down instead): {below}"
    assert all(any(f == s or (s.endswith("/") and f.startswith(s)) for f in found) for s in PROCESS_STARTS), \
        "a listed process start no longer reads the environment: remove it from PROCESS_STARTS"
    assert reads.search("x = os.environ.get('A')") and not reads.search("environ = {}")  # (the pattern can fail)
