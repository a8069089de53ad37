"""Streaming DiLoCo (--strategy diloco --fragments P --overlap-steps τ; distrain.parallel.diloco.streaming)
against its ground truths, fp64 at rel 1e-10.

* The cut: gpt-tiny's 69 tensors in 4 contiguous fragments of exact sizes, each cut at the boundary nearest
  k·N/4; too many fragments refused.
* A run equals tests/test_diloco.py's single-process simulation extended with fragments and overlap (every
  step's loss, each island's final parameters, θ_prev, and the averaged Δ of an exchange still in flight at
  the end, which the checkpoint holds): 2 islands with P = 2, τ = 1, α = 0.5 (fast tier); 3 islands with
  P = 4, τ = 0; 2 islands of 2 ranks (DDP inside) with P = 3, τ = 2, α = 0; P = 2, τ = 1 with bf16 on the
  wire (its own reference: the simulation's mean is exact, so the bf16 run only matches to bf16's rounding).
* H = 1 with P = 4 fragments (all offsets 0), outer SGD at lr 1, inner SGD: DDP's step, as DiLoCo's.
* Traffic: over a whole H-period the ledger's bytes equal the unfragmented run's, each a ring all-reduce of
  its fragment (the closed form), and the largest step's bytes fall to the largest fragment's exchange.
* A run stopped with an exchange in flight (and one stopped on a send step) and resumed equals the
  uninterrupted one bit for bit.
* Refusals, one line each.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import assert_refused, reference_losses, train_losses, trainer_config
from test_diloco import EXACT_H1, SGD_DDP, assert_params_close, close, outer_bytes, shard, simulate


# -- the cut ----------------------------------------------------------------------------------------
def test_gpt_tiny_in_four_fragments():
    from distrain.errors import ConfigError
    from distrain.models import build_model
    from distrain.parallel.diloco import fragment_cuts

    sizes = [p.numel() for p in build_model("gpt-tiny").parameters()]
    assert len(sizes) == 69 and sum(sizes) == 67_776
    cuts = fragment_cuts(sizes, 4)
    # the cuts nearest 16,944, 33,888 and 50,832 elements: after 17,152 (not 13,056), 34,080 (not 29,984 or
    # 34,112), 51,072 (not 50,048 or 51,104)
    assert cuts == [(0, 15), (15, 33), (33, 59), (59, 69)]
    assert [sum(sizes[a:b]) for a, b in cuts] == [17_152, 16_928, 16_992, 16_704]
    assert fragment_cuts(sizes, 1) == [(0, 69)]
    assert len(fragment_cuts(sizes, 69)) == 69
    with pytest.raises(ConfigError, match="^--fragments 70: the model has 69 parameter tensors"):
        fragment_cuts(sizes, 70)


# -- the simulation ------------------------------------------------------------------------------------
def check_against_simulation(tmp_path, *, nproc: int, islands: int, K: int, fragments: int, overlap: int,
                             alpha: float = 0.5, steps: int = 6, inner_steps: int = 4, **kw) -> None:
    cfg = trainer_config(tmp_path / "run", strategy="diloco", nproc=nproc, islands=islands, inner_steps=inner_steps,
                         fragments=fragments, overlap_steps=overlap, overlap_alpha=alpha, steps=steps, **kw)
    got = train_losses(cfg)
    losses, states, master, left = simulate(cfg, K, fragments=fragments, overlap=overlap, alpha=alpha)
    assert close(got, losses), (got, losses)
    names = list(master)
    for i in range(K):
        saved = shard(cfg.out, f"island{i}")
        assert_params_close(saved["model"], states[i])
        outer = saved["outer"]
        got_master = [m for f in outer["fragments"] for m in f["master"]]
        assert_params_close(dict(zip(names, got_master)), master)
        assert sorted(e["fragment"] for e in outer["pending"]) == sorted(left)
        for e in outer["pending"]:
            want = left[e["fragment"]]
            flat = torch.cat([t.reshape(-1) for t in want.values()])
            torch.testing.assert_close(e["mean"], flat, rtol=1e-10, atol=1e-13)
    return cfg, left


@pytest.mark.timeout(120)
def test_two_fragments_overlapped_equal_the_simulation(tmp_path):
    """H = 4, P = 2 (offsets 0 and 2), τ = 1: fragment 1 sent after step 1 and applied after step 2,
    fragment 0 sent after 3 and applied after 4, fragment 1 sent again after 5: in flight at the end."""
    cfg, left = check_against_simulation(tmp_path, nproc=2, islands=0, K=2, fragments=2, overlap=1)
    assert list(left) == [1]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["outer_syncs"] == 2 and s["fragments"] == 2 and s["overlap_steps"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc,islands,K,fragments,overlap,alpha", [
    (3, 0, 3, 4, 0, 0.5), (4, 2, 2, 3, 2, 0.0), (2, 0, 2, 4, 3, 1.0)], ids=["P4-blocking", "2x2-ddp-P3-tau2-a0",
                                                                          "P4-tau3-a1"])
def test_fragments_and_overlap_equal_the_simulation(tmp_path, nproc, islands, K, fragments, overlap, alpha):
    check_against_simulation(tmp_path, nproc=nproc, islands=islands, K=K, fragments=fragments, overlap=overlap,
                             alpha=alpha, steps=9)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_h1_with_four_fragments_is_ddp(tmp_path, tmp_path_factory):
    got = train_losses(trainer_config(tmp_path / "run", strategy="diloco", nproc=2, fragments=4, **EXACT_H1,
                                      **SGD_DDP))
    ref = reference_losses(tmp_path_factory, **SGD_DDP)
    assert close(got, ref), (got, ref)


# -- traffic -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_period_sends_the_unfragmented_bytes_and_the_peak_falls_to_a_fragment(tmp_path):
    from distrain.models import build_model
    from distrain.parallel.diloco import fragment_cuts

    sizes = [p.numel() for p in build_model("gpt-tiny").parameters()]
    n = sum(sizes)
    frag = [sum(sizes[a:b]) for a, b in fragment_cuts(sizes, 4)]
    base = dict(strategy="diloco", nproc=2, inner_steps=8, steps=8, dtype="float32")
    runs = {}
    for name, kw in (("diloco", {}), ("P4", dict(fragments=4)), ("P4-tau2-bf16", dict(fragments=4, overlap_steps=2,
                                                                                       outer_compression="bf16"))):
        out = tmp_path / name
        train_losses(trainer_config(out, **base, **kw))
        runs[name] = json.loads((out / "summary.json").read_text())
    whole = outer_bytes(n, 2, 4)
    assert whole == 4 * n == 271_104  # one ring all-reduce of the float32 model on 2 ranks: 2(2 - 1)/2 x 4N
    assert runs["diloco"]["bytes_sent_per_step_rank0"] * 8 == whole
    assert runs["diloco"]["peak_step_bytes_rank0"] == whole
    s = runs["P4"]
    assert s["fragment_params"] == frag and s["outer_syncs"] == 4
    assert s["bytes_sent_per_step_rank0"] * 8 == sum(outer_bytes(m, 2, 4) for m in frag) == whole
    assert s["peak_step_bytes_rank0"] == max(outer_bytes(m, 2, 4) for m in frag) == 4 * 17_152
    b = runs["P4-tau2-bf16"]  # fragment 0's exchange (sent after step 7) completes at the end: all counted
    assert b["bytes_sent_per_step_rank0"] * 8 == sum(outer_bytes(m, 2, 2) for m in frag) == whole // 2


# -- resume --------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [3, 4], ids=["exchange-in-flight", "after-an-apply"])
def test_a_resumed_streaming_run_equals_the_uninterrupted_one(tmp_path, stop):
    """H = 4, P = 2, τ = 2: fragment 1 sent after step 1, applied after step 3; fragment 0 sent after 3,
    applied after 5. Stopping after 3 steps leaves fragment 1's exchange pending, after 4 fragment 0's."""
    kw = dict(strategy="diloco", nproc=2, inner_steps=4, fragments=2, overlap_steps=2)
    whole = tmp_path / "whole"
    ref = train_losses(trainer_config(whole, steps=8, **kw))
    out = tmp_path / "resumed"
    train_losses(trainer_config(out, steps=stop, ckpt_every=stop, **kw))
    assert len(shard(out, "island0")["outer"]["pending"]) == 1
    got = train_losses(trainer_config(out, steps=8, resume=True, **kw))
    assert got == ref
    for i in range(2):
        a, b = shard(out, f"island{i}"), shard(whole, f"island{i}")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        for fa, fb in zip(a["outer"]["fragments"], b["outer"]["fragments"]):
            assert all(torch.equal(x, y) for x, y in zip(fa["master"], fb["master"]))
    from distrain.errors import ConfigError
    from distrain.trainer.loop import check_resume

    for change, message in ((dict(fragments=3), "--fragments is 3 but the checkpoint"),
                            (dict(overlap_steps=1), "--overlap-steps is 1 but the checkpoint")):
        with pytest.raises(ConfigError, match=message):
            check_resume(trainer_config(out, steps=10, resume=True, **{**kw, **change}))


# -- refusals ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    (dict(strategy="ddp", fragments=2), "--fragments applies only to --strategy diloco"),
    (dict(strategy="zero1", overlap_steps=1), "--overlap-steps applies only to --strategy diloco"),
    (dict(strategy="ddp", overlap_alpha=0.2), "--overlap-alpha applies only to --strategy diloco"),
    (dict(fragments=0), "--fragments must be >= 1 (1: all parameters synchronise together), got 0"),
    (dict(fragments=70), "--fragments 70: --model gpt-tiny has 69 parameter tensors"),
    (dict(inner_steps=4, overlap_steps=4), "--overlap-steps must be in 0..--inner-steps - 1 = 3"),
    (dict(inner_steps=4, overlap_steps=-1), "--overlap-steps must be in 0..--inner-steps - 1 = 3"),
    (dict(inner_steps=4, overlap_steps=1, overlap_alpha=1.5), "--overlap-alpha must be in [0, 1], got 1.5"),
    (dict(inner_steps=4, overlap_steps=1, outer_compression="int4"),
     "--overlap-steps 1 with --outer-compression int4: the quantized mean is two blocking exchanges"),
    (dict(fragments=69, inner_steps=4, overlap_steps=3, overlap_alpha=1.0, outer_compression="bf16"), None),
])
def test_refusals(tmp_path, kw, message):
    assert_refused(trainer_config(tmp_path, **{"strategy": "diloco", **kw}), message)
