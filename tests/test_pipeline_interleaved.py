"""Interleaved 1F1B (Narayanan et al. 2021): the schedule cannot deadlock, its simulated bubble is
(p-1)/(v*m) exactly, and the executor equals one process in fp64 over several optimizer steps."""

from __future__ import annotations

import pytest
import torch

from distrain import Topology
from distrain.errors import ConfigError
from distrain.models import build_model, lm_loss
from distrain.parallel.pipeline_parallel import (
    InterleavedStage, interleaved_bubble, interleaved_ops, interleaved_step, simulate_interleaved,
)

from conftest import one_process_losses, run_ranks

B, T, STEPS = 12, 8, 3


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_simulated_bubble_is_p_minus_1_over_v_m(p, v, mult):
    m = mult * p
    tl = simulate_interleaved(p, v, m)  # raises ScheduleDeadlock if any rank could block forever
    compute = tl.compute_time()
    assert (p * tl.makespan() - compute) / compute == pytest.approx(interleaved_bubble(p, v, m), abs=1e-12)
    assert tl.bubble_fraction() == pytest.approx(tl.expected_bubble(), abs=1e-12)  # (p-1)/(v m + p - 1): --gantt's
    for r in range(p):  # every (chunk, micro-batch) forward once, backward once, forward first
        ops = interleaved_ops(p, r, v, m)
        fwd = [(c, k) for kind, c, k in ops if kind == "F"]
        bwd = [(c, k) for kind, c, k in ops if kind == "B"]
        assert sorted(fwd) == sorted(bwd) == [(c, k) for c in range(v) for k in range(m)]
        assert all(ops.index(("F",) + x) < ops.index(("B",) + x) for x in bwd)


def test_interleaved_needs_m_multiple_of_p():
    with pytest.raises(ConfigError, match=r"num_microbatches=3 must be a multiple of the pipeline size p=2"):
        interleaved_ops(2, 0, 2, 3)


def _reference():
    torch.manual_seed(0)
    m = build_model("gpt-tiny").double()
    return one_process_losses(m, torch.optim.Adam(m.parameters(), lr=1e-2), lm_loss, map(_batch, range(STEPS))), m


def _batch(step: int):
    g = torch.Generator().manual_seed(4000 + step)
    ids = torch.randint(0, 256, (B, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _interleaved(rank: int, v: int, m: int) -> list[str]:
    ref_losses, ref = _reference()
    topo = Topology.from_world(pp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    stage = InterleavedStage.from_topology(build_model("gpt-tiny").double(), topo, v, balance=[1] * 6)
    opt = torch.optim.Adam(stage.parameters(), lr=1e-2)
    bad = []
    last = topo.pp_rank == topo.pp - 1
    for s in range(STEPS):
        x, y = _batch(s)
        opt.zero_grad()
        loss = interleaved_step(stage, x if topo.pp_rank == 0 else None, y if last else None,
                                lm_loss if last else None, num_microbatches=m)
        if last and abs(loss.item() - ref_losses[s]) > 1e-12:
            bad.append(f"step {s}: loss {loss.item()!r} != {ref_losses[s]!r}")
        opt.step()
    for c, (a, b) in enumerate(stage.bounds):
        for (n, p), q in zip(stage.chunks[c].named_parameters(),
                             torch.nn.Sequential(*ref.layers[a:b]).parameters()):
            if not torch.allclose(p, q, rtol=1e-9, atol=1e-12):
                bad.append(f"chunk {c} (layers {a}:{b}) {n}: max diff {(p - q).abs().max().item():.2e}")
    return [f"rank {rank} p={topo.pp} v={v} m={m}: {b}" for b in bad]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("p,v,m", [(2, 3, 2), (2, 3, 4), (3, 2, 6)])
def test_interleaved_equals_one_process(p, v, m):
    run_ranks(_interleaved, p, v, m, timeout=200)


# ---- the trainer: distrain train --schedule interleaved --virtual-stages V ------------------------


def test_whole_names_map_every_chunk_to_its_layers():
    """A rank's chunks c hold layers c*p + r of the p*v parts: each local name (parameters and buffers)
    names in the whole model the very tensor the chunk holds, and the ranks' names cover it once."""
    from distrain.checkpoint.reshard import stage_full_name

    torch.manual_seed(0)
    model = build_model("gpt-tiny")
    whole = model.state_dict(keep_vars=True)
    seen = []
    for r in range(2):
        stage = InterleavedStage(model, r, 2, 3, [0, 1], balance=[1] * 6)  # 6 layers: one per chunk
        assert stage.bounds == [(r, r + 1), (2 + r, 3 + r), (4 + r, 5 + r)]
        full = stage_full_name(stage)
        for n, t in stage.state_dict(keep_vars=True).items():
            assert whole[full(n)] is t, n
            seen.append(full(n))
    assert sorted(seen) == sorted(whole)
    with pytest.raises(ConfigError, match=r"'layers.0.weight' is not a name of this stage's chunks"):
        stage.whole_name("layers.0.weight")


def _final_model(out) -> dict:
    from distrain.checkpoint.reshard import consolidate

    return consolidate(out)["model"]


def _assert_same_model(got: dict, ref: dict) -> None:
    assert got.keys() == ref.keys()
    for n, t in ref.items():
        torch.testing.assert_close(got[n], t, rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The single-process run of conftest's EVAL job: its metrics lines and final weights."""
    from conftest import EVAL, train_rows, trainer_config

    out = tmp_path_factory.mktemp("single")
    rows = train_rows(trainer_config(out, **EVAL, strategy="single", nproc=1))
    return rows, _final_model(out)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [
    dict(nproc=2, pp=2, microbatches=2),                                    # 4 chunks of gpt-tiny's 6 layers
    dict(nproc=3, pp=3, microbatches=3, activation_checkpointing=True),     # one layer per chunk, blocks re-run
    dict(nproc=4, dp=2, pp=2, microbatches=2),                              # DDP over dp
    dict(nproc=4, dp=2, pp=2, microbatches=2, strategy="zero1"),            # ZeRO-1: one reduce per step
    dict(nproc=4, dp=2, pp=2, microbatches=2, strategy="zero2"),            # ZeRO-2: a reduce per chunk backward
])
def test_trainer_interleaved_equals_one_process(tmp_path, one_process, layout):
    """fp64: every step's loss, both evaluations and the final weights equal one process's, and the
    last step's trace holds each rank's v forwards and v backwards of every micro-batch."""
    import json

    from conftest import EVAL, assert_rows_equal, train_rows, trainer_config

    ref_rows, ref_model = one_process
    trace = tmp_path / "trace.json"
    out = tmp_path / "run"
    rows = train_rows(trainer_config(out, **EVAL, schedule="interleaved", trace=str(trace), **layout))
    assert_rows_equal(rows, ref_rows)
    _assert_same_model(_final_model(out), ref_model)
    p, m, v = layout["pp"], layout["microbatches"], 2
    manifest = json.loads((out / "checkpoint.json").read_text())
    assert manifest["layout"] == {"dp": layout.get("dp", 1), "tp": 1, "pp": p, "virtual_stages": v,
                                  **({"zero": int(layout["strategy"][-1])} if "strategy" in layout else {})}
    events = json.loads(trace.read_text())
    ops = sorted((e["pid"], e["name"]) for e in events["traceEvents"] if e.get("ph") == "X" and e["cat"] in "FB")
    assert ops == sorted((s, f"{k}{i}") for s in range(p) for k in "FB" for i in range(m) for _ in range(v))
    assert events["otherData"]["expected_bubble"] == (p - 1) / (v * m + p - 1)


def _job(out, **kw):
    from conftest import trainer_config

    return trainer_config(out, **{"nproc": 2, "pp": 2, "microbatches": 2, "schedule": "interleaved", **kw})


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_trainer_interleaved_resume_continues_exactly(tmp_path):
    from conftest import train_losses
    from distrain.trainer import train

    full = _job(tmp_path / "full", steps=5)
    want = train_losses(full)
    part = tmp_path / "part"
    train(_job(part, steps=3))
    assert sorted(q.name for q in part.glob("checkpoint*")) == [
        "checkpoint-00000003-tp0-pp0.pt", "checkpoint-00000003-tp0-pp1.pt", "checkpoint.json"]
    with pytest.raises(ConfigError, match=r"was written with layout \{'dp': 1, 'tp': 1, 'pp': 2, 'virtual_stages': 2\}"
                                          r", this run uses \{'dp': 1, 'tp': 1, 'pp': 2\}; resume with the same"):
        train(_job(part, steps=5, resume=True, schedule="1f1b"))  # other layers in each shard: not loadable as is
    assert train_losses(_job(part, steps=5, resume=True)) == want
    _assert_same_model(_final_model(part), _final_model(tmp_path / "full"))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("a,b", [
    (dict(), dict(strategy="single", nproc=1, pp=1, microbatches=1, schedule="1f1b")),   # interleaved -> one process
    (dict(), dict(nproc=2, pp=1, microbatches=1, schedule="1f1b")),                      # interleaved -> ddp dp2
    (dict(schedule="1f1b"), dict(nproc=3, pp=3, microbatches=3)),                        # 1f1b pp2 -> interleaved pp3
])
def test_trainer_interleaved_reshards_to_and_from_other_layouts(tmp_path, tmp_path_factory, a, b):
    """Saved at step 3 under layout a, resumed with --reshard under b: steps 3 and 4 are one process's."""
    from conftest import reference_losses
    from distrain.trainer import train
    from distrain.trainer.metrics import read_metrics

    ref = reference_losses(tmp_path_factory, model="gpt-tiny", data="shakespeare")
    out = tmp_path / "run"
    train(_job(out, steps=3, **a))
    train(_job(out, steps=5, resume=True, reshard=True, **b))
    got = [r["loss"] for r in read_metrics(out / "metrics.jsonl")]
    assert len(got) == 5
    torch.testing.assert_close(torch.tensor(got[3:]), torch.tensor(ref[3:]), rtol=1e-11, atol=0)


@pytest.mark.parametrize("kw,match", [
    (dict(virtual_stages=1), r"^--virtual-stages must be >= 2 model chunks per pipeline rank, got 1; use "
                             r"--virtual-stages 2 or more \(one chunk per rank is --schedule 1f1b\)$"),
    (dict(microbatches=3), r"^--schedule interleaved runs micro-batches through each chunk in groups of --pp 2: "
                           r"--microbatches 3 must be a multiple of 2; use --microbatches 2$"),
    (dict(virtual_stages=4), r"^--pp 2 x --virtual-stages 4 = 8 chunks, but gpt-tiny has 6 layers \(embedding, 4 "
                             r"blocks, head\); use --virtual-stages 3 or fewer$"),
    (dict(nproc=4, pp=4, microbatches=4), r"^--pp 4 x --virtual-stages 2 = 8 chunks, but gpt-tiny has 6 layers "
                                          r"\(embedding, 4 blocks, head\); use --pp 3 or fewer$"),
    (dict(pp=1, dp=2, microbatches=1), r"^--schedule interleaved spreads chunks of layers over pipeline ranks: it "
                                       r"needs --pp >= 2, got --pp 1; add --pp 2 or more, or drop --schedule$"),
    (dict(schedule="1f1b", virtual_stages=3), r"^--virtual-stages 3 applies to --schedule interleaved only \(got "
                                              r"--schedule 1f1b\); add --schedule interleaved or drop "
                                              r"--virtual-stages$"),
])
def test_trainer_refuses_bad_virtual_stages(tmp_path, kw, match):
    with pytest.raises(ConfigError, match=match):
        _job(tmp_path / "bad", **kw).validate()
