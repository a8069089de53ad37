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
