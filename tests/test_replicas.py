"""Silent data corruption across replicas: --check-replicas N and DISTRAIN_INJECT=bitflip:STEP:RANK.

Fast: the bit flip, the digest (a changed bit changes it), the majority rule, the message, the parsing,
the refusals. Slow (multi-process runs through the CLI): a flip at P = 3 named by the majority, at P = 2
both ranks named and the checkpoint due at the detection not written, no flip and every check passes.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

from distrain import checkpoint, runtime
from distrain.errors import ConfigError
from distrain.topology import Topology
from distrain.trainer import TrainConfig
from distrain.trainer.metrics import read_metrics
from distrain.trainer.replicas import (BitFlip, check_inject, digest, disagreeing, flip_bit, mismatch_message,
                                       optimizer_tensors, parse_inject)

TINY = ["--model", "mlp-tiny", "--data", "digits", "--batch-size", "24", "--no-progress", "--eval-every", "0",
        "--no-report", "--sample-chars", "0"]


# -- the bit flip and the digest ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,bits", [(torch.float32, torch.int32), (torch.float64, torch.int64),
                                        (torch.bfloat16, torch.int16), (torch.float16, torch.int16)])
def test_flip_bit_flips_the_lowest_bit_of_the_first_element_only(dtype, bits):
    t = torch.tensor([[1.5, -2.0], [0.25, 3.0]], dtype=dtype)
    before = t.clone()
    flip_bit(t)
    assert t.view(bits).view(-1)[0].item() == before.view(bits).view(-1)[0].item() ^ 1
    assert t.view(-1)[0].item() != before.view(-1)[0].item()  # the value changed (one unit in the last place)
    assert torch.equal(t.view(-1)[1:], before.view(-1)[1:])
    zero = torch.zeros(3, dtype=dtype)
    flip_bit(zero)
    assert zero[0].item() > 0 and zero[1:].eq(0).all()  # 0.0 becomes the smallest subnormal


def test_a_flipped_bit_changes_the_digest_and_equal_bits_keep_it():
    torch.manual_seed(0)
    state = [torch.randn(64, 32), torch.randn(32), torch.tensor(3.0)]  # (a 0-dim optimizer step too)
    d = digest(state)
    assert len(d) == 16 and d == digest([t.clone() for t in state])
    h = hashlib.sha256()  # the documented form: dtype, shape, raw bytes, per tensor in order; the first 16 bytes
    for t in state:
        h.update(f"{t.dtype}{tuple(t.shape)};".encode() + t.numpy().tobytes())
    assert d == h.digest()[:16]
    for i in range(len(state)):
        flipped = [t.clone() for t in state]
        flip_bit(flipped[i])
        assert digest(flipped) != d
    assert digest(state[::-1]) != d  # the order is part of it
    assert digest([state[0].view(32, 64)] + state[1:]) != d  # and the shapes, with the same bytes


def test_optimizer_state_in_a_fixed_order():
    w, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w, b], lr=0.1)
    assert optimizer_tensors(opt) == []  # no state before the first step
    (w.sum() + 2 * b.sum()).backward()
    opt.step()
    got = optimizer_tensors(opt)
    want = [opt.state[p][k] for p in (w, b) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert len(got) == 6 and all(g is s for g, s in zip(got, want))


# -- the majority rule and the message -----------------------------------------------------------------
@pytest.mark.parametrize("digests,bad", [
    ("aaa", []), ("aba", [1]), ("baa", [0]), ("ab", [0, 1]), ("aa", []), ("abc", [0, 1, 2]),
    ("aabb", [0, 1, 2, 3]), ("aaabb", [3, 4]), ("abaa", [1]), ("a", []),
])
def test_the_majority_decides_which_ranks_differ(digests, bad):
    assert disagreeing([c.encode() * 16 for c in digests]) == bad


def test_the_message_names_the_step_the_ranks_and_the_checkpoint_kept():
    assert mismatch_message(6, [0, 1, 2], [1], 4, "runs/x") == (
        "replica check at step 6: rank 1 holds other parameters and optimizer state than the majority of its 3 "
        "replicas (ranks 0, 1, 2); the last good checkpoint is step 4 in runs/x (--resume continues from it)")
    assert mismatch_message(3, [1, 3], [1, 3], None, "o") == (
        "replica check at step 3: ranks 1, 3 hold different parameters and optimizer state (2 replicas, no "
        "majority); no checkpoint was written before it")
    assert mismatch_message(2, [0, 2, 4, 6, 8], [4, 8], 0, "o").startswith(
        "replica check at step 2: ranks 4, 8 hold other parameters and optimizer state than the majority of their "
        "5 replicas (ranks 0, 2, 4, 6, 8); the last good checkpoint is step 0")


# -- parsing and refusals --------------------------------------------------------------------------------
def test_parse_inject_is_strict():
    assert parse_inject(None) is None and parse_inject("") is None
    assert parse_inject("bitflip:3:1") == BitFlip(step=3, rank=1)
    assert runtime.injected_fault({"DISTRAIN_INJECT": "bitflip:0:0"}) == "bitflip:0:0"
    assert runtime.injected_fault({}) is None
    for bad in ("bitflip:3", "bitflip:3:1:2", "bitflip:-1:0", "bitflip:x:1", "flip:3:1", "bitflip:3:1,", "3:1"):
        with pytest.raises(ConfigError) as e:
            parse_inject(bad)
        assert str(e.value) == (f"DISTRAIN_INJECT={bad!r} is not bitflip:STEP:RANK (two integers >= 0, e.g. "
                                f"bitflip:3:1); fix it or unset DISTRAIN_INJECT")


def test_inject_must_fit_the_run():
    ddp = TrainConfig(strategy="ddp", nproc=2, steps=5)
    assert check_inject(BitFlip(4, 1), ddp) == BitFlip(4, 1)
    with pytest.raises(ConfigError, match=r"^DISTRAIN_INJECT=bitflip:4:2: rank 2 is not a rank of this job "
                                          r"\(--nproc 2\); give a rank below 2$"):
        check_inject(BitFlip(4, 2), ddp)
    with pytest.raises(ConfigError, match=r"^DISTRAIN_INJECT=bitflip:5:0: step 5 is not a step of this run"):
        check_inject(BitFlip(5, 0), ddp)
    with pytest.raises(ConfigError, match=r"^DISTRAIN_INJECT=bitflip:0:0: flips a bit of one replica, but "
                                          r"--strategy single runs one process"):
        check_inject(BitFlip(0, 0), TrainConfig(strategy="single", nproc=1, steps=5))


@pytest.mark.parametrize("flags,msg", [
    (["--check-replicas", "-1"], "--check-replicas must be a number of steps >= 0 (0: off), got -1"),
    (["--strategy", "single", "--nproc", "1", "--check-replicas", "5"],
     "--check-replicas 5 compares the bits of replicas, but --strategy single runs one process: there is no "
     "replica to compare with; drop --check-replicas or use --strategy ddp"),
    (["--strategy", "zero2", "--check-replicas", "5"],
     "--check-replicas 5 compares the bits of replicas, but --strategy zero2: each ZeRO rank holds a different "
     "shard of the optimizer state (and with zero3 of the parameters); drop --check-replicas or use --strategy ddp"),
    (["--strategy", "ps-sync", "--nproc", "3", "--check-replicas", "5"],
     "--check-replicas 5 compares the bits of replicas, but --strategy ps-sync: the state lives on the parameter "
     "servers, each a different shard (a worker's copy is a pull, not state); drop --check-replicas or use "
     "--strategy ddp"),
    (["--strategy", "ddp", "--nproc", "1", "--check-replicas", "5"],
     "--check-replicas 5 compares the bits of replicas, but the layout holds one replica of each shard (dp 1 x "
     "cp 1); drop --check-replicas or use --strategy ddp"),
])
def test_check_replicas_refusals_are_one_line_errors(tmp_path, flags, msg, capsys):
    from distrain.cli import main

    assert main(["train", *TINY, "--out", str(tmp_path / "r"), *flags]) == 2
    assert capsys.readouterr().err == f"distrain: error: {msg}\n"
    assert not (tmp_path / "r").exists()


def test_a_malformed_inject_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    from distrain.cli import main
    from distrain.trainer import train

    monkeypatch.setenv("DISTRAIN_INJECT", "bitflip:2")
    assert main(["train", *TINY, "--out", str(tmp_path / "r"), "--check-replicas", "2"]) == 2
    assert capsys.readouterr().err == ("distrain: error: DISTRAIN_INJECT='bitflip:2' is not bitflip:STEP:RANK (two "
                                       "integers >= 0, e.g. bitflip:3:1); fix it or unset DISTRAIN_INJECT\n")
    assert not (tmp_path / "r").exists()
    monkeypatch.setenv("DISTRAIN_INJECT", "bitflip:2:9")  # the Python API reads it too (distrain.train)
    with pytest.raises(ConfigError, match=r"^DISTRAIN_INJECT=bitflip:2:9: rank 9 is not a rank of this job"):
        train(TrainConfig(model="mlp-tiny", data="digits", nproc=2, steps=4, out=str(tmp_path / "api")))
    assert not (tmp_path / "api").exists()


# -- runs ------------------------------------------------------------------------------------------------
class Ran:
    """What a run through the CLI's ``main`` left: its exit status and everything written to stderr (the
    top process's and its ranks', file descriptor 2), as a subprocess's ``returncode`` and ``stderr``."""

    def __init__(self, returncode: int, stderr: str):
        self.returncode, self.stderr = returncode, stderr


@pytest.fixture
def train(capfd, monkeypatch):
    """``distrain train`` through the CLI's main in this process (nothing here is about the process boundary:
    a subprocess would only import torch and start a fork server again, ~4 s of CPU a run), the injected fault
    in DISTRAIN_INJECT, read at the top of the run as in a command's process."""
    from distrain.cli import main

    def run(out: Path, nproc: int, inject: str | None, *flags: str, job=TINY) -> Ran:
        for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DISTRAIN_PARENT_PID", "DISTRAIN_RESUME"):
            monkeypatch.delenv(k, raising=False)
        if inject:
            monkeypatch.setenv("DISTRAIN_INJECT", inject)
        else:
            monkeypatch.delenv("DISTRAIN_INJECT", raising=False)
        capfd.readouterr()
        code = main(["train", *job, "--strategy", "ddp", "--nproc", str(nproc), "--out", str(out), *flags])
        return Ran(code, capfd.readouterr().err)

    return run


def _checkpoint_steps(out: Path) -> list[int]:
    return sorted({int(p.name.split("-")[1]) for p in out.glob("checkpoint-*.pt")})


def _error_line(p: Ran) -> str:
    """The one line of the ReplicaMismatchError (whichever replica reported first)."""
    lines = [ln for ln in p.stderr.splitlines() if "ReplicaMismatchError" in ln]
    assert len(lines) == 1, p.stderr[-3000:]
    m = re.fullmatch(r"distrain: error: rank \d failed: ReplicaMismatchError: (.*)", lines[0])
    assert m, lines[0]
    return m[1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_flipped_bit_at_three_replicas_is_named_by_the_majority(tmp_path, train):
    out = tmp_path / "run"
    # the flip after step 4's update (state of step 5 on); checks at 3, 4 (a checkpoint), 6: caught at 6
    p = train(out, 3, "bitflip:4:2", "--steps", "8", "--check-replicas", "3", "--ckpt-every", "4")
    assert p.returncode != 0
    assert _error_line(p) == (f"replica check at step 6: rank 2 holds other parameters and optimizer state than "
                              f"the majority of its 3 replicas (ranks 0, 1, 2); the last good checkpoint is step 4 "
                              f"in {out} (--resume continues from it)")
    assert checkpoint.read_manifest(out)["step"] == 4 and _checkpoint_steps(out) == [4]
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "replica_check_s" in r] == [2, 3]  # the checks that passed (steps 3, 4)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_replicas_are_both_named_and_the_checkpoint_due_at_the_detection_is_not_written(tmp_path, train):
    out = tmp_path / "run"
    # the flip after step 4's update; checks at 3 (a checkpoint), 4, 6 (a checkpoint, due after the flip)
    p = train(out, 2, "bitflip:4:0", "--steps", "8", "--check-replicas", "4", "--ckpt-every", "3")
    assert p.returncode != 0
    assert _error_line(p) == (f"replica check at step 6: ranks 0, 1 hold different parameters and optimizer state "
                              f"(2 replicas, no majority); the last good checkpoint is step 3 in {out} (--resume "
                              f"continues from it)")
    assert checkpoint.read_manifest(out)["step"] == 3 and _checkpoint_steps(out) == [3]  # not 6: after the flip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_a_flip_every_check_passes(tmp_path, train):
    out = tmp_path / "run"
    p = train(out, 2, None, "--steps", "5", "--check-replicas", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = read_metrics(out / "metrics.jsonl")
    # checks at steps 2 and 4 and before the final checkpoint (5): the lines of steps 1, 3, 4
    assert [r["step"] for r in rows if "replica_check_s" in r] == [1, 3, 4]
    assert checkpoint.read_manifest(out)["step"] == 5


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_with_a_pipeline_the_replicas_of_the_flipped_stage_are_named(tmp_path, train):
    out = tmp_path / "run"
    gpt = ["--model", "gpt-tiny", "--batch-size", "8", "--no-progress", "--eval-every", "0", "--no-report",
           "--sample-chars", "0"]
    p = train(out, 4, "bitflip:1:3", "--dp", "2", "--pp", "2", "--steps", "3", "--check-replicas", "2", job=gpt)
    assert p.returncode != 0
    # rank 3's replicas: the dp x cp group of its pipeline stage (the other stage's group agrees and says nothing)
    group = next(g for g in Topology(dp=2, tp=1, pp=2, rank=3, world_size=4).groups_of("dp_cp") if 3 in g)
    assert len(group) == 2 and 3 in group
    assert _error_line(p) == (f"replica check at step 2: ranks {', '.join(map(str, group))} hold different "
                              f"parameters and optimizer state (2 replicas, no majority); no checkpoint was written "
                              f"before it")
    assert not (out / checkpoint.MANIFEST).exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_train_times_the_check(tmp_path, capsys):
    import json

    from distrain.cli import main

    out = tmp_path / "b.json"
    assert main(["bench", "train", "--nproc", "2", "--strategies", "ddp", "--model", "mlp-tiny", "--steps", "3",
                 "--warmup", "1", "--batch-size", "16", "--check-replicas", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    records = {r["strategy"]: r for r in data["records"]}
    assert data["meta"]["check_replicas"] == 2 and records["single"]["replica_check_ms"] is None
    ddp = records["ddp"]  # checks after steps 2 and 4 (the final checkpoint's): both timed (after the warm-up)
    assert ddp["replica_check_ms"] > 0
    assert ddp["replica_check_share"] == pytest.approx(ddp["replica_check_ms"] / (2 * ddp["step_ms"]))
    assert (f"ddp on 2: replica check (hash + all-gather) {ddp['replica_check_ms']:.1f} ms, "
            f"{100 * ddp['replica_check_share']:.2f}% of the step time at --check-replicas 2") in capsys.readouterr().out
    assert main(["bench", "train", "--nproc", "2", "--strategies", "local", "--model", "mlp-tiny",
                 "--check-replicas", "2"]) == 2
    assert capsys.readouterr().err == ("distrain: error: --check-replicas 2 times the replica check of ddp's jobs; "
                                       "add ddp to --strategies or drop --check-replicas\n")
