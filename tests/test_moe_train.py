"""Expert parallelism through the trainer equals one process (fp64, rel 1e-10): llama-moe-tiny (4
experts, top-2, load-balancing loss on) with capacity unlimited, plain ddp on 2 ranks, ep2 on 2 ranks,
ep2 on 4 ranks (two ep groups: every expert on 2 ranks, its gradients summed over them) and ep2 with
cp2 (ep borrows the cp ranks), tp2 and tp2 x ep2 (the mixture whole on the tp ranks); training losses, the validation losses of a mid-run and a final
evaluation, and the router's slot counts. A capacity factor drops slots and the metrics count them;
the checkpoint of an ep run holds the whole model (consolidated from the ep ranks' shards); gradient
clipping and activation checkpointing under ep equal one process. ZeRO 1-3 and the synchronous
parameter server count the router's slots over their data ranks too, so they equal one process as well."""

from __future__ import annotations

import os

import pytest
import torch

import distrain
from distrain.trainer.metrics import read_metrics

from conftest import EVAL, assert_rows_equal, reference_rows, train_rows, trainer_config


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("layout", [
    dict(nproc=2),                # --strategy ddp: every expert on both ranks, the router's counts summed
    dict(ep=2, nproc=2),
    dict(ep=2, nproc=4),          # dp x cp = 4: ep groups [0,1] [2,3], expert replicas [0,2] [1,3]
    dict(ep=2, cp=2, nproc=4),    # ep borrows from dp x cp: the ep groups are the cp groups
    dict(tp=2, nproc=2),          # the mixture whole on both tp ranks (tp_replicated), attention split
    dict(ep=2, tp=2, nproc=4),    # tp x ep: ep groups [0,2] [1,3], one per tp coordinate
    dict(strategy="zero1", nproc=2),  # ZeRO: the grid engine sums the router's counts over its data ranks
    dict(strategy="zero2", nproc=3),
    dict(strategy="zero3", nproc=2),
], ids=lambda v: "-".join(f"{k}{v}" for k, v in v.items()))
def test_trainer_expert_parallel_equals_one_process(tmp_path, tmp_path_factory, layout):
    ref = reference_rows(tmp_path_factory, model="llama-moe-tiny")
    got = train_rows(trainer_config(tmp_path / "ep", model="llama-moe-tiny", **EVAL, **layout))
    assert_rows_equal(got, ref, rel=1e-10)
    for g, r in zip(got, ref):
        # every slot of the global batch counted once, none dropped: 2 layers x 12 x 32 tokens x top-2
        assert (g["moe_dropped"], g["moe_routed"]) == (r["moe_dropped"], r["moe_routed"]) == (0, 2 * 12 * 32 * 2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_synchronous_parameter_server_trains_a_mixture_as_one_process(tmp_path, tmp_path_factory):
    """ps-sync, 2 workers and 1 server: the workers' routers count over both workers, so every step's loss
    (load-balancing term included) and the slot counts are one process's (fp64, rel 1e-10)."""
    kw = dict(model="llama-moe-tiny", steps=3, log_every=1)
    ref = train_rows(trainer_config(tmp_path / "one", strategy="single", nproc=1, **kw))
    got = train_rows(trainer_config(tmp_path / "ps", strategy="ps-sync", nproc=3, **kw))
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=1e-10, abs=0)
    assert [(g["moe_dropped"], g["moe_routed"]) for g in got] == [(0, 2 * 12 * 32 * 2)] * 3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_capacity_factor_drops_slots_and_counts_them(tmp_path):
    """Capacity 0.5 x the even share: at most ceil(0.5 * 192 * 2 / 4) = 48 slots per expert of a rank's 192
    tokens, so at least half of the 768 slots of each layer drop; the count is summed over the ranks."""
    from distrain.checkpoint import reshard

    cfg = trainer_config(tmp_path / "cap", model="llama-moe-tiny", ep=2, nproc=2, steps=2, log_every=1)
    from distrain.models import build_model

    torch.manual_seed(0)
    model = build_model("llama-moe-tiny", moe=dict(num_experts=4, top_k=2, capacity_factor=0.5)).double()
    distrain.train(model=model, config=cfg)
    rows = read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
    assert [r["moe_routed"] for r in rows] == [2 * 12 * 32 * 2] * 2
    assert all(2 * 384 <= r["moe_dropped"] < 2 * 768 for r in rows)  # per layer: >= half of 768 slots dropped
    whole = reshard.consolidate(cfg.out)["model"]  # the ep ranks' shards join into the whole model
    assert sorted(k for k in whole if "experts" in k and k.startswith("layers.1.")) == sorted(
        f"layers.1.feed_forward.experts.{e}.{w}.weight" for e in range(4) for w in ("w1", "w2", "w3"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_clipping_and_activation_checkpointing_under_ep_equal_one_process(tmp_path):
    """--grad-clip takes the whole model's norm (an expert lives on dp x cp / ep ranks: its squares count ep
    times); --activation-checkpointing re-runs the blocks' all-to-alls in backward, on every rank alike."""
    kw = dict(model="llama-moe-tiny", grad_clip=0.5, steps=3, log_every=1)
    ref = train_rows(trainer_config(tmp_path / "one", strategy="single", nproc=1, **kw))
    got = train_rows(trainer_config(tmp_path / "ep", ep=2, nproc=4, activation_checkpointing=True, **kw))
    assert [g["loss"] for g in got] == pytest.approx([r["loss"] for r in ref], rel=1e-10, abs=0)
    unclipped = train_rows(trainer_config(tmp_path / "free", strategy="single", nproc=1, **dict(kw, grad_clip=0.0)))
    assert abs(unclipped[-1]["loss"] - ref[-1]["loss"]) > 1e-4  # the clip acted


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_tp_x_ep_checkpoint_consolidates_to_the_one_process_model(tmp_path):
    """tp2 x ep2 on 4 ranks: the attention split by tp, the experts by ep, the mixture whole on the tp
    ranks; the checkpoint's shards join into the whole model, equal to one process's after the same
    steps (fp64, rel 1e-10) tensor by tensor."""
    from distrain.checkpoint import reshard

    kw = dict(model="llama-moe-tiny", steps=3, log_every=1)
    distrain.train(trainer_config(tmp_path / "one", strategy="single", nproc=1, **kw))
    distrain.train(trainer_config(tmp_path / "tpep", tp=2, ep=2, nproc=4, **kw))
    ref = reshard.consolidate(str(tmp_path / "one"))["model"]
    got = reshard.consolidate(str(tmp_path / "tpep"))["model"]
    assert sorted(got) == sorted(ref)
    for k in ref:
        # atol: AdamW divides by sqrt(v); an element whose gradients are near 0 keeps rounding at 1e-15
        torch.testing.assert_close(got[k], ref[k], rtol=1e-10, atol=1e-12, msg=lambda m, k=k: f"{k}: {m}")
