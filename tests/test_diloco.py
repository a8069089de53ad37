"""--strategy diloco (docs/slow_links.md) against its ground truths, fp64 at rel 1e-10.

* H = 1, outer SGD at lr 1 without momentum, inner SGD without momentum: the step is DDP's
  (θ_prev − mean_i(θ_prev − θ_i) = mean_i θ_i), so the losses and the final parameters equal one
  process's and --strategy ddp's on the same global batch.
* Any H with the Nesterov outer step: a single-process simulation of the islands written here in
  plain torch (K model copies, each stepping its part of every batch with its own AdamW; every H
  steps the mean of θ_prev − θ_i drives torch.optim.SGD(nesterov=True) on a master copy, which every
  island then takes), for K = 2 and 3 islands of one rank and K = 2 islands of two ranks (DDP inside):
  every step's loss, each island's final parameters and the outer parameters.
* The traffic: the ledger's bytes are exactly the outer all-reduces' (the ring's closed form), 1/H of
  DDP's per step; bf16 on the wire halves float32's.
* A run stopped at a sync boundary (and one stopped between syncs) and resumed equals the uninterrupted one.
* Refusals: the diloco flags with other strategies, and bad values, each a one-line ConfigError.

The fast tier runs the refusals and the two-island simulation (one 2-rank job); the rest is slow.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from conftest import assert_refused, reference_losses, train_losses, trainer_config

RTOL = 1e-10
SGD_DDP = dict(optimizer="sgd", momentum=0.0)  # inner SGD without momentum
EXACT_H1 = dict(inner_steps=1, outer_optimizer="sgd", outer_lr=1.0, outer_momentum=0.0)


def close(a: list[float], b: list[float], rtol: float = RTOL) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def shard(out, name: str) -> dict:
    from distrain import checkpoint

    return checkpoint.load_shard(out, checkpoint.read_manifest(out), name)


def assert_params_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=RTOL, atol=1e-13, msg=lambda m: f"{k}: {m}")


def _float_means(deltas: list) -> list:
    """The islands' mean Δ per tensor in float (``deltas``: one list of tensors per island)."""
    return [torch.stack(ds).mean(dim=0) for ds in zip(*deltas)]


def simulation_parts(cfg, parts=None):
    """What a one-process simulation of the islands starts from: (the run's seeded model, its task, its loss
    function, its batch sampler), built as the trainer builds them (``parts``: the caller's, as
    ``distrain.train(model=...)`` got them; else the config's)."""
    from distrain.data import DistributedBatchSampler
    from distrain.trainer.custom import UserParts
    from distrain.trainer.loop import new_model, sequence_length
    from distrain.trainer.task import build_task, loss_function

    cpu = torch.device("cpu")
    parts = parts if parts is not None else UserParts.from_config(cfg)
    start = new_model(cfg, parts, cpu)
    task = build_task(cfg, sequence_length(cfg, start), cpu, parts)
    return start, task, loss_function(cfg, parts), DistributedBatchSampler(len(task.train), cfg.batch_size,
                                                                           seed=cfg.seed)


def outer_steps(step: int, held: list, master: list, outer: list, cuts: list, pending: dict, *, H: int,
                fragments: int, overlap: int, alpha: float, mean) -> None:
    """Streaming DiLoCo's outer schedule after inner step ``step``, in one process, as the engine runs it
    (parallel/diloco/streaming.py, outer.py): first the exchanges due now are applied with the merge
    θ_i ← α·θ_i + (1 − α)·master (``pending``: fragment -> (its step, its mean Δ per tensor)); then each
    fragment f whose offset comes up ((step + 1 − f·H//P) mod H = 0) has its mean Δ taken (``mean``: the
    islands' Δ lists of the fragment's tensors -> one mean per tensor) and applied at once (τ = 0: every
    island takes the master) or held for ``overlap`` steps. ``held``: each island's parameter list;
    ``outer``: one optimizer per fragment over its master slice ``cuts[f]``."""

    def apply(f: int, means: list, merge: bool) -> None:
        a, b = cuts[f]
        for w, g in zip(master[a:b], means):
            w.grad = g
        outer[f].step()
        for ps in held:
            for p, w in zip(ps[a:b], master[a:b]):
                p.copy_(p.mul(alpha).add_(w, alpha=1 - alpha) if merge else w)

    for f in sorted(pending):
        if pending[f][0] == step:
            apply(f, pending.pop(f)[1], merge=True)
    for f, (a, b) in enumerate(cuts):
        if (step + 1 - f * H // fragments) % H == 0:
            means = mean([[master[j] - ps[j] for j in range(a, b)] for ps in held])
            if overlap:
                pending[f] = (step + overlap, means)
            else:
                apply(f, means, merge=False)


def simulate(cfg, K: int, fragments: int = 1, overlap: int = 0, alpha: float = 0.5, parts=None, mean=None):
    """DiLoCo in one process, plain torch: (the step losses, each island's final state_dict, the outer
    parameters by name, the exchanges not yet applied {fragment: mean Δ by name}). Island i reads part i of
    K of every global batch (the trainer's ranks' parts joined: consecutive ranks form an island).

    Streaming DiLoCo (``fragments`` P, ``overlap`` τ, ``alpha`` α): the parameters in P contiguous
    fragments (distrain's cut: fragment_cuts), each with its own torch.optim.SGD on its master slice;
    fragment p's mean Δ is taken after steps s with (s + 1 − p·H//P) mod H = 0 and applied then (τ = 0:
    every island takes the master) or after step s + τ (every island: α·θ_i + (1 − α)·master). ``parts``: the
    caller's model instead of the config's (simulation_parts). ``mean``: the islands' Δ lists of a fragment's
    tensors -> one mean per tensor (default: in float, :func:`_float_means`)."""
    from distrain.parallel.diloco import fragment_cuts
    from distrain.trainer.task import build_optimizer

    start, task, loss_fn, sampler = simulation_parts(cfg, parts)
    islands = [copy.deepcopy(start) for _ in range(K)]
    inner = [build_optimizer(cfg, m.parameters()) for m in islands]
    names = [n for n, _ in start.named_parameters()]
    master = [p.detach().clone() for p in start.parameters()]
    cuts = fragment_cuts([w.numel() for w in master], fragments)
    outer = [torch.optim.SGD(master[a:b], lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                             nesterov=cfg.outer_optimizer == "nesterov") for a, b in cuts]
    H = cfg.inner_steps
    pending = {}  # fragment -> (the step after which it applies, the mean Δ of each of its tensors)
    losses = []
    for step in range(cfg.steps):
        step_loss = 0.0
        for i, (m, opt) in enumerate(zip(islands, inner)):
            x, y = task.batch(task.train, sampler.part(step, i, K))
            opt.zero_grad()
            loss = loss_fn(m(x), y)
            loss.backward()
            opt.step()
            step_loss += loss.item() / K
        losses.append(step_loss)
        with torch.no_grad():
            outer_steps(step, [list(m.parameters()) for m in islands], master, outer, cuts, pending, H=H,
                        fragments=fragments, overlap=overlap, alpha=alpha, mean=mean or _float_means)
    left = {f: dict(zip(names[cuts[f][0]:cuts[f][1]], means)) for f, (_, means) in pending.items()}
    return losses, [m.state_dict() for m in islands], dict(zip(names, master)), left


# -- H = 1 with SGD everywhere: DDP ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(90)
def test_h1_outer_sgd_lr1_equals_one_process_and_ddp(tmp_path, tmp_path_factory):
    out = tmp_path / "diloco"
    got = train_losses(trainer_config(out, strategy="diloco", nproc=2, **EXACT_H1, **SGD_DDP))
    ref = reference_losses(tmp_path_factory, **SGD_DDP)
    assert close(got, ref), (got, ref)
    ddp_out = tmp_path / "ddp"
    ddp = train_losses(trainer_config(ddp_out, strategy="ddp", nproc=2, **SGD_DDP))
    assert close(got, ddp), (got, ddp)
    want = shard(ddp_out, "tp0-pp0")["model"]
    for i in range(2):
        assert_params_close(shard(out, f"island{i}")["model"], want)


# -- any H, Nesterov outside: the simulation --------------------------------------------------------
@pytest.mark.timeout(90)
def test_h2_nesterov_equals_the_simulation_two_islands(tmp_path):
    check_against_simulation(tmp_path, nproc=2, islands=0, K=2)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc,islands,K", [(3, 0, 3), (4, 2, 2)], ids=["P3", "2x2-ddp-inside"])
def test_h2_nesterov_equals_the_simulation(tmp_path, nproc, islands, K):
    check_against_simulation(tmp_path, nproc=nproc, islands=islands, K=K)


def check_against_simulation(tmp_path, nproc: int, islands: int, K: int) -> None:
    """5 steps at H = 2 (syncs after steps 2 and 4, then one inner step): the losses, every island's
    parameters after its unsynchronised last step, and the outer parameters."""
    cfg = trainer_config(tmp_path / "run", strategy="diloco", nproc=nproc, islands=islands, inner_steps=2)
    got = train_losses(cfg)
    losses, states, master, _ = simulate(cfg, K)
    assert close(got, losses), (got, losses)
    for i in range(K):
        saved = shard(cfg.out, f"island{i}")
        assert_params_close(saved["model"], states[i])
        assert saved["outer"]["syncs"] == 2
        assert_params_close(dict(zip(master, saved["outer"]["master"])), master)
    w = next(iter(states[0]))  # the islands differ after the step past the last sync: a real check
    assert not torch.equal(states[0][w], states[1][w])


# -- traffic ----------------------------------------------------------------------------------------
def outer_bytes(nparams: int, K: int, elem: int) -> int:
    """Rank 0's bytes sent by one ring all-reduce of the flat outer gradient over K ranks."""
    from distrain.comm.algorithms.cost import traffic

    return traffic("all_reduce", "ring", K, 0, nparams, elem)[0]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_the_ledger_counts_exactly_the_outer_all_reduces_and_bf16_halves_them(tmp_path):
    from distrain.models import build_model

    nparams = sum(p.numel() for p in build_model("gpt-tiny").parameters())
    base = dict(strategy="diloco", nproc=2, inner_steps=3, steps=6, dtype="float32")
    for comp, elem in ((None, 4), ("bf16", 2)):
        out = tmp_path / f"run-{comp}"
        train_losses(trainer_config(out, outer_compression=comp, **base))
        s = json.loads((out / "summary.json").read_text())
        assert s["outer_syncs"] == 2 and s["inner_steps"] == 3
        assert s["bytes_sent_per_step_rank0"] * 6 == 2 * outer_bytes(nparams, 2, elem)


# -- resume -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [4, 3], ids=["at-a-sync", "between-syncs"])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, stop):
    kw = dict(strategy="diloco", nproc=2, inner_steps=2)
    whole = tmp_path / "whole"
    ref = train_losses(trainer_config(whole, steps=6, **kw))
    out = tmp_path / "resumed"
    train_losses(trainer_config(out, steps=stop, ckpt_every=stop, **kw))
    got = train_losses(trainer_config(out, steps=6, resume=True, **kw))
    assert got == ref  # the same computation on the same bits
    for i in range(2):
        a, b = shard(out, f"island{i}"), shard(whole, f"island{i}")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
        assert all(torch.equal(x, y) for x, y in zip(a["outer"]["master"], b["outer"]["master"]))
    # a resume that would not continue exactly is refused before any rank starts
    from distrain.errors import ConfigError
    from distrain.trainer.run_folder import check_resume

    for change, message in ((dict(inner_steps=3), "--inner-steps is 3 but the checkpoint"),
                            (dict(outer_lr=0.5), "--outer-lr is 0.5 but the checkpoint"),
                            (dict(islands=1), "was written with layout")):
        with pytest.raises(ConfigError, match=message):
            check_resume(trainer_config(out, steps=8, resume=True, **{**kw, **change}))


# -- refusals -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    (dict(strategy="ddp", inner_steps=3), "--inner-steps applies only to --strategy diloco"),
    (dict(strategy="zero2", outer_lr=0.5), "--outer-lr applies only to --strategy diloco"),
    (dict(strategy="single", nproc=1, islands=1), "--islands applies only to --strategy diloco"),
    (dict(strategy="ddp", outer_optimizer="sgd"), "--outer-optimizer applies only to --strategy diloco"),
    (dict(strategy="ps-sync", outer_momentum=0.5), "--outer-momentum applies only to --strategy diloco"),
    (dict(strategy="ddp", outer_compression="bf16"), "--outer-compression applies only to --strategy diloco"),
    (dict(inner_steps=0), "--inner-steps must be a whole number of steps >= 1, got 0"),
    (dict(outer_lr=0.0), "--outer-lr must be a positive finite number, got 0.0"),
    (dict(outer_lr=float("nan")), "--outer-lr must be a positive finite number, got nan"),
    (dict(outer_momentum=1.0), "--outer-momentum must be in [0, 1), got 1.0"),
    (dict(outer_momentum=-0.1), "--outer-momentum must be in [0, 1), got -0.1"),
    (dict(outer_momentum=0.0), "--outer-optimizer nesterov needs --outer-momentum > 0"),
    (dict(outer_optimizer="adam"), "--outer-optimizer 'adam' is unknown; use nesterov or sgd"),
    (dict(outer_compression="int2"), "--outer-compression 'int2' is unknown; use bf16 or int8 or int4"),
    (dict(nproc=4, islands=3), "--islands 3 does not divide --nproc 4 into equal islands"),
    (dict(nproc=2, islands=3), "--islands must be in 0..--nproc 2"),
    (dict(nproc=2, islands=-1), "--islands must be in 0..--nproc 2"),
    # islands that are grids: tests/test_diloco_grid.py; one rank per island holds no tp 2
    (dict(nproc=2, tp=2), "each of the 2 islands has --nproc / --islands = 1 rank(s)"),
    (dict(nproc=4, islands=2, elastic="2:4"), None),  # valid: islands of 2 ranks (tests/test_diloco_elastic.py)
    (dict(nproc=4, islands=2, elastic="2:4", outer_compression="int4"),
     "--outer-compression int4 with --islands 2 is not supported"),
    (dict(nproc=2, elastic="1:2"), None),  # valid: elastic, one rank per island (tests/test_diloco_elastic.py)
    (dict(nproc=2, check_replicas=2), "each island keeps its own inner optimizer state"),
    (dict(nproc=2, accum_steps=2), "--accum-steps applies to single, ddp and torch-ddp"),
    (dict(nproc=2, outer_optimizer="sgd", outer_momentum=0.0, islands=1), None),  # valid: one island, plain steps
])
def test_refusals(tmp_path, kw, message):
    kw = {"strategy": "diloco", **kw}
    assert_refused(trainer_config(tmp_path, **kw), message)
