"""--strategy diloco --layout-invariant: the same bits whatever ranks each island has (docs/determinism.md,
docs/slow_links.md).

Inside an island its M ranks run the island's units of work one at a time and sum the gradients as int64
(InvariantTraining over the island group); across islands the mean of Δ is an int64 sum at one exponent per
tensor taken from the largest |Δ| over the islands (parallel/diloco/exact.py). Every run is float32 with
--grad-clip on, compared with ``==`` and ``torch.equal`` (no tolerance):

* K = 2 islands of M = 1 rank against K = 2 islands of M = 2 ranks: every step's loss, each island's final
  parameters, inner optimizer state and outer state (θ_prev, momentum, syncs). 6 units of 2 samples: an
  island's 3 units split 2 + 1 between its two ranks. Plain DiLoCo, and Streaming DiLoCo (2 fragments,
  an overlap of one step).
* The same runs against a one-process simulation of the islands: K model copies, each stepping its units
  through the invariant primitives (InvariantStep, FixedPointGradients, clip_exact) with its own AdamW; the
  outer mean of the K deltas summed here as integers with fixed_point's quantize at shared exponents, then
  torch.optim.SGD(nesterov=True) on a master copy.
* The refusals (trainer/checks/invariant.py), one line each, before any run folder exists.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from conftest import run_ranks, train_losses, trainer_config
from test_diloco import outer_steps, shard, simulation_parts

K = 2
UNITS = 6
STREAMING = dict(fragments=2, overlap_steps=1)


def job(out, nproc: int, **kw):
    """K = 2 islands (or ``islands``) of nproc / K ranks, gpt-tiny float32, 6 units of 2 samples, H = 2
    (Nesterov outside), clipped at 0.5 (the exact-norm clip acts in most steps), 5 steps: syncs after steps 2
    and 4, and one unsynchronised step after them, so the islands differ at the end."""
    base = dict(strategy="diloco", nproc=nproc, islands=K, dtype="float32", layout_invariant=True, units=UNITS,
                inner_steps=2, steps=5, log_every=1, grad_clip=0.5)
    return trainer_config(out, **{**base, **kw})


_RUNS: dict = {}


def run(tmp_path_factory, nproc: int, streaming: bool, islands: int = K) -> tuple:
    """(the config, its logged losses) of ``job(nproc)``, trained once per session."""
    key = (nproc, streaming, islands)
    if key not in _RUNS:
        cfg = job(tmp_path_factory.mktemp(f"diloco-inv-{nproc}-{islands}-{int(streaming)}"), nproc, islands=islands,
                  **(STREAMING if streaming else {}))
        _RUNS[key] = (cfg, train_losses(cfg))
    return _RUNS[key]


def differences(a, b, where: str = "") -> list[str]:
    """Where two nested states (dicts, lists, tensors, numbers) are not bit for bit the same."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        ok = torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(map(str, a))} != {sorted(map(str, b))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


# -- (1) islands of one rank and of two: the same bits ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("streaming", [False, True], ids=["diloco", "streaming-P2-tau1"])
def test_islands_of_one_and_of_two_ranks_are_bit_for_bit_the_same(tmp_path_factory, streaming):
    one_cfg, one = run(tmp_path_factory, 2, streaming)
    two_cfg, two = run(tmp_path_factory, 4, streaming)
    assert len(one) == 5 and one == two, (one, two)
    for i in range(K):
        a, b = shard(one_cfg.out, f"island{i}"), shard(two_cfg.out, f"island{i}")
        assert set(a) >= {"model", "optimizer", "outer"}
        assert differences(a["model"], b["model"]) == []
        assert differences(a["optimizer"]["state"], b["optimizer"]["state"]) == []
        assert differences(a["outer"], b["outer"]) == []
    m0, m1 = shard(one_cfg.out, "island0")["model"], shard(one_cfg.out, "island1")["model"]
    w = next(iter(m0))  # the islands differ after the last, unsynchronised step: a real check
    assert not torch.equal(m0[w], m1[w])


# -- (1b) islands that are grids: ZeRO over two ranks, the same bits as islands of one rank --------------------
def outer_master(out, island: int, names: list[str], like: list[torch.Tensor]) -> list[torch.Tensor]:
    """A grid island's θ_prev as whole tensors (in ``names``' order, shaped as ``like``), put together from
    the pieces its ranks' shard files hold (test_diloco_grid.shard_pieces: which elements of which tensor)."""
    from test_diloco_grid import island_shards, shard_pieces

    shards = island_shards(out, island)
    if not shards:  # islands of one rank (the plain engine): its shard ``island{i}`` holds them whole
        return list(shard(out, f"island{island}")["outer"]["master"])
    whole = {n: torch.full_like(t.detach(), float("nan")) for n, t in zip(names, like)}
    for meta in shards.values():
        pieces = shard_pieces(meta, names)
        assert len(pieces) == len(meta["outer"]["master"])
        for (name, _, elements), piece in zip(pieces, meta["outer"]["master"]):
            whole[name].view(-1)[elements(whole[name].shape)] = piece.reshape(-1)
    return [whole[n] for n in names]


def _piece_exponents(rank: int) -> list[str]:
    """Rank r holds piece r of tensor 0 (its largest |value| on rank 1) and all of tensor 1 (rank 1's differs)."""
    from distrain.parallel.diloco import exact
    from distrain.parallel.invariant.fixed_point import scale_exponents

    t0 = torch.tensor([0.5, -0.25, 3.0, 1.0])  # tensor 0 (4,): rank 0 holds [:2], rank 1 [2:]
    t1 = torch.tensor([0.125, 6.0]) if rank else torch.tensor([0.125, 0.75])
    flat = torch.cat([t0[2 * rank:2 * rank + 2], t1])
    got = exact.exponents_of(flat, [2, 2], 2, tensors=(2, [0, 1]))
    want = (scale_exponents([3.0, 6.0], 2, headroom=0), [True, True])
    own = exact.exponents_of(flat, [2, 2], 2)  # (no group: this rank's own maxima)
    bad = [] if got == want else [f"exponents {got}, not the whole tensors' {want}"]
    if rank == 0 and own[0][0] == want[0][0]:
        bad.append("rank 0's own piece has the whole tensor's exponent: the check cannot fail")
    return bad


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_piece_gets_its_whole_tensors_exponent():
    """Grid islands hold pieces of tensors (ZeRO-3's flat shards): each piece's exponent is its whole tensor's
    over every rank (exact.exponents_of's ``tensors``), the one an island holding the tensor whole computes."""
    run_ranks(_piece_exponents, 2, timeout=60)


GRID_ISLANDS = {"zero2": dict(inner_strategy="zero2"), "zero3": dict(inner_strategy="zero3"),
                "tp2": dict(tp=2, invariant_tp=True),
                # 12 fragments: dp rank 0's flat shards hold nothing of fragment 5 (EmptyFragment's exponent exchange)
                "zero3-streaming-P12-tau1": dict(inner_strategy="zero3", fragments=12, overlap_steps=1)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(GRID_ISLANDS))
def test_grid_islands_of_two_ranks_are_bit_for_bit_islands_of_one(tmp_path, layout):
    """K = 2 islands of ZeRO-2 or ZeRO-3 over 2 ranks, or of tp 2 (engines/diloco_grid.py), against K = 2
    islands of one rank (4 units: an island's 2 split 1 + 1, as ZeRO-3's collective all-gathers need; with
    --invariant-tp both run the canonical tensor-parallel layers; Streaming DiLoCo on ZeRO-3 islands against
    streaming islands of one rank, P = 12, τ = 1): every step's loss and each island's
    θ_prev, put together from its ranks' pieces (tp slices; ZeRO-3: parts of its flat shards, each with its
    whole tensor's exponent: test_a_piece_gets_its_whole_tensors_exponent; here a piece's own exponent
    rounded the same float32 bits, its ~60-bit sums far finer than float32), bit for bit."""
    from distrain.models import build_model

    kw = GRID_ISLANDS[layout]
    same = {k: v for k, v in kw.items() if k in ("invariant_tp", "fragments", "overlap_steps")}
    one_cfg = job(tmp_path / "one", 2, units=4, **same)
    one = train_losses(one_cfg)
    cfg = job(tmp_path / layout, 4, units=4, **kw)
    got = train_losses(cfg)
    assert len(one) == 5 and got == one, (got, one)
    if "fragments" in kw:  # (Streaming DiLoCo: its outer state is per fragment; the losses hold every exchange)
        outer = shard(cfg.out, "island1-tp0-pp0-dp1")["outer"]
        assert [f["syncs"] for f in outer["fragments"]] == \
            [f["syncs"] for f in shard(one_cfg.out, "island1")["outer"]["fragments"]]
        rank0 = shard(cfg.out, "island0-tp0-pp0-dp0")["outer"]["fragments"]
        empty = [p for p, f in enumerate(rank0) if not f["master"]]
        assert empty == [5], empty  # (the case covers a rank that holds nothing of a fragment)
        return
    names = [n for n, _ in build_model(cfg.model).named_parameters()]
    like = list(build_model(cfg.model).parameters())
    for i in range(K):
        want = outer_master(one_cfg.out, i, names, like)
        assert differences(outer_master(cfg.out, i, names, like), want) == []
    dp = "-dp1" if "zero" in layout else ""
    assert shard(cfg.out, f"island1-tp{int('tp' in kw)}-pp0{dp}")["outer"]["syncs"] == 2


# -- (2) a one-process simulation of the islands ------------------------------------------------------------------
def fixed_point_means(deltas: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The islands' mean of each tensor: ``deltas[i][j]`` island i's Δ of tensor j. One exponent per tensor from
    the largest |Δ| over the K islands (no headroom: every addend is known), the integers summed, the sum
    back as float64 times 2**-e over K, one rounding to the tensor's dtype."""
    from distrain.parallel.invariant.fixed_point import quantize, scale_exponents

    means = []
    for column in zip(*deltas):
        top = max(float(d.abs().max()) for d in column)
        e = scale_exponents([top], len(column), headroom=0)[0]
        total = sum(quantize(d, e) for d in column)
        means.append((total.to(torch.float64) * 2.0 ** -e / len(column)).to(column[0].dtype))
    return means


def simulate(cfg, K: int, fragments: int = 1, overlap: int = 0, alpha: float = 0.5):
    """DiLoCo --layout-invariant in one process: (the step losses, each island's final state_dict and inner
    optimizer, the outer parameters, the outer optimizers, the exchanges not yet applied {fragment: (the step
    after which it applies, the mean Δ of each of its tensors)}). Island i trains global units i·U/K .. of every
    batch, each alone (InvariantStep at unit i·U/K + k's seed), their gradients summed as int64
    (FixedPointGradients, no group), clipped by the exact norm; the step's loss is fsum of the islands' / K.
    The outer step as tests/test_diloco.py's simulation (Streaming DiLoCo's fragments and overlap included)
    with :func:`fixed_point_means` for the mean."""
    from distrain.parallel.diloco import fragment_cuts
    from distrain.parallel.invariant import FixedPointGradients, InvariantStep, clip_exact
    from distrain.parallel.zero.layout import make_unit
    from distrain.trainer.task import build_optimizer, lr_at

    start, task, loss_fn, sampler = simulation_parts(cfg)
    per, spu = UNITS // K, cfg.batch_size // UNITS
    islands = [copy.deepcopy(start) for _ in range(K)]
    inner = [build_optimizer(cfg, m.parameters()) for m in islands]
    steppers = []
    for i, m in enumerate(islands):
        named = [(n, p) for n, p in m.named_parameters() if p.requires_grad]
        grads = FixedPointGradients([make_unit(0, named, 1)], [[p for _, p in named]], addends=per)
        steppers.append(InvariantStep(m, loss_fn, grads, units=per, replica_units=range(per), seed=cfg.seed,
                                      first=i * per))
    numel = sum(p.numel() for p in start.parameters())
    master = [p.detach().clone() for p in start.parameters()]
    cuts = fragment_cuts([w.numel() for w in master], fragments)
    outer = [torch.optim.SGD(master[a:b], lr=cfg.outer_lr, momentum=cfg.outer_momentum,
                             nesterov=cfg.outer_optimizer == "nesterov") for a, b in cuts]
    H = cfg.inner_steps
    pending = {}  # fragment -> (the step after which it applies, the mean Δ of each of its tensors)
    losses = []
    for step in range(cfg.steps):
        island_losses = []
        for i, (m, opt, run_units) in enumerate(zip(islands, inner, steppers)):
            x, y = task.batch(task.train, sampler.part(step, i, K, spu))
            for group in opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            opt.zero_grad(set_to_none=True)
            island_losses.append(run_units(x, y, step))
            run_units.grads.gradients()
            clip_exact([p.grad for p in m.parameters()], cfg.grad_clip, addends=numel)
            opt.step()
        losses.append(math.fsum(island_losses) / K)
        with torch.no_grad():
            outer_steps(step, [list(m.parameters()) for m in islands], master, outer, cuts, pending, H=H,
                        fragments=fragments, overlap=overlap, alpha=alpha, mean=fixed_point_means)
    return losses, islands, inner, master, outer, pending


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("K,streaming", [(2, False), (2, True), (3, False)],
                         ids=["diloco-K2", "streaming-K2-P2-tau1", "diloco-K3"])
def test_islands_equal_a_one_process_simulation_bit_for_bit(tmp_path_factory, K, streaming):
    """K = 3: a float mean of three deltas depends on the order of its additions (the ring's differs by chunk),
    the fixed-point mean does not."""
    cfg, got = run(tmp_path_factory, K, streaming, islands=K)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as every rank of the run: a kernel's reduction order may follow the threads)
    try:
        losses, islands, inner, master, outer, pending = simulate(cfg, K, **(dict(fragments=2, overlap=1)
                                                                              if streaming else {}))
    finally:
        torch.set_num_threads(threads)
    assert got == losses, (got, losses)
    for i in range(K):
        saved = shard(cfg.out, f"island{i}")
        assert differences(saved["model"], islands[i].state_dict()) == []
        assert differences(saved["optimizer"]["state"], inner[i].state_dict()["state"]) == []
        o = saved["outer"]
        if streaming:  # each fragment's θ_prev and momentum, and fragment 1's exchange of step 4, due after 5
            assert [len(f["master"]) for f in o["fragments"]] == [len(opt.param_groups[0]["params"]) for opt in outer]
            assert differences([m for f in o["fragments"] for m in f["master"]], master) == []
            assert differences([f["optimizer"]["state"] for f in o["fragments"]],
                               [opt.state_dict()["state"] for opt in outer]) == []
            assert [f["syncs"] for f in o["fragments"]] == [2, 2] and list(pending) == [1]
            assert [(p["fragment"], p["apply_after"]) for p in o["pending"]] == [(1, pending[1][0])] == [(1, 5)]
            assert torch.equal(o["pending"][0]["mean"], torch.cat([m.reshape(-1) for m in pending[1][1]]))
        else:
            assert o["syncs"] == 2
            assert differences(o["master"], master) == []
            assert differences(o["optimizer"]["state"], outer[0].state_dict()["state"]) == []


def test_an_islands_units_draw_the_random_numbers_of_their_global_index():
    """Island i's unit k is global unit i·U/K + k (InvariantStep's ``first``): its forward's random numbers
    (dropout) are that unit's wherever it runs, and differ from another island's unit k."""
    from torch import nn

    from distrain.parallel.invariant import FixedPointGradients, InvariantStep, unit_seed
    from distrain.parallel.zero.layout import make_unit

    class Draws(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.drawn = nn.Linear(2, 1), []

        def forward(self, x):
            self.drawn.append(torch.rand(()))
            return self.lin(x)

    def drawn(first: int) -> list:
        m = Draws()
        named = list(m.named_parameters())
        grads = FixedPointGradients([make_unit(0, named, 1)], [[p for _, p in named]], addends=2)
        InvariantStep(m, lambda out, y: (out - y).square().mean(), grads, units=2, replica_units=range(2), seed=5,
                      first=first)(torch.ones(4, 2), torch.zeros(4, 1), 7)
        return m.drawn

    want = []
    for k in (3, 4):
        torch.manual_seed(unit_seed(5, 7, k))
        want.append(torch.rand(()))
    assert drawn(3) == want and drawn(0) != want


# -- (3) refusals -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    (dict(units=3), "--layout-invariant with --strategy diloco: each of the 2 islands trains --units 3 / 2 of every "
                    "batch, so --islands 2 must divide --units; use --units 4 or another --islands"),
    (dict(outer_compression="bf16"), "--layout-invariant sums the islands' outer gradients as integers at shared "
                                     "exponents; drop --outer-compression bf16"),
    (dict(outer_compression="int8"), "drop --outer-compression int8"),
    (dict(nproc=2, islands=0, elastic="1:2"), "--layout-invariant with --strategy diloco is not elastic"),
    (dict(units=2), "--layout-invariant: 4 data-parallel replicas cannot share 2 units"),  # M = 2 > U / K = 1
    (dict(units=4), None),  # 2 units per island, one per rank
    (dict(nproc=2, units=6), None),  # islands of one rank
    (dict(units=4, inner_strategy="zero3"), None),  # islands of ZeRO-3 over 2 ranks: 2 units each, 1 per replica
    (dict(units=6, inner_strategy="zero3"), "--layout-invariant with --strategy diloco islands of --inner-strategy "
                                            "zero3: every replica of an island must run the same number of units (its "
                                            "all-gathers are collective), so the island's 2 replicas must divide its "
                                            "--units / --islands = 3 units; use --units 4"),
    (dict(units=6, inner_strategy="zero2"), None),
    (dict(units=4, tp=2, invariant_tp=True), None),  # islands of tp 2 (one replica each)
    (dict(units=4, pp=2, microbatches=2), "--layout-invariant with --strategy diloco islands of --pp is not supported"),
    (dict(units=4, tp=2, invariant_tp=True, inner_strategy="zero2", nproc=8),
     "--layout-invariant with --tp 2 covers --strategy ddp without --pp"),
    (dict(units=4, inner_strategy="zero2", fragments=2), None),
])
def test_refusals(tmp_path, kw, message):
    from distrain.errors import ConfigError

    out = tmp_path / "run"
    cfg = job(out, **{"nproc": 4, **kw})
    if message is None:
        cfg.validate()
        return
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not out.exists()
