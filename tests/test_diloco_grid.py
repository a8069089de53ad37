"""--strategy diloco whose islands are grids (--tp/--pp/--inner-strategy zeroN inside each island;
engines/diloco_grid.py), fp64 against its ground truths at rel 1e-10.

* K = 2 islands, each tp = 2, or ZeRO-2 / ZeRO-3 over 2 ranks, or a 2-stage pipeline (4 ranks), H = 2 with
  the Nesterov outer step: every step's loss equals test_diloco's one-process simulation of K = 2 islands
  (K model copies, each its own AdamW on its part of every batch, the outer SGD(nesterov) on a master copy),
  through two outer steps and an inner step past the last.
* H = 1, outer SGD at lr 1 without momentum, inner SGD: the step is the plain grid's, so the losses equal one
  process's.
* A run stopped between syncs and resumed equals the uninterrupted one, bit for bit (shards
  ``island{i}-tp{t}-pp{p}``, each with its outer state).
* Refusals: what the grid islands do not do yet, each a one-line ConfigError naming the flag.

In float32 through ``distrain.train(model=...)`` against the same simulation: tests/test_python_api_float32.py.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import assert_refused, reference_losses, train_losses, trainer_config
from test_diloco import EXACT_H1, SGD_DDP, close, shard, simulate

LAYOUTS = {"tp2": dict(tp=2), "zero2": dict(inner_strategy="zero2"), "zero3": dict(inner_strategy="zero3"),
           "pp2": dict(pp=2, microbatches=2), "cp2": dict(cp=2)}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_grid_islands_equal_the_simulation(tmp_path, layout):
    """4 ranks, K = 2 islands of 2, H = 2, 5 steps (syncs after steps 2 and 4): the losses of every step."""
    cfg = trainer_config(tmp_path / "run", strategy="diloco", nproc=4, islands=2, inner_steps=2, **LAYOUTS[layout])
    got = train_losses(cfg)
    losses, _, _, _ = simulate(cfg, 2)
    assert close(got, losses), (got, losses)
    assert shard(cfg.out, "island1-tp0-pp0" + ("-dp1" if "zero" in layout else ""))["outer"]["syncs"] == 2


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_h1_outer_sgd_lr1_is_the_plain_grid(tmp_path, tmp_path_factory):
    got = train_losses(trainer_config(tmp_path / "run", strategy="diloco", nproc=4, islands=2, tp=2, **EXACT_H1,
                                      **SGD_DDP))
    ref = reference_losses(tmp_path_factory, **SGD_DDP)
    assert close(got, ref), (got, ref)


STREAMING = {"tp2-P3-tau2-a0": dict(tp=2, fragments=3, overlap_steps=2, overlap_alpha=0.0),
             "zero3-P3-tau1": dict(inner_strategy="zero3", fragments=3, overlap_steps=1),
             "pp2-P4-tau1": dict(pp=2, microbatches=2, fragments=4, overlap_steps=1, overlap_alpha=0.5),
             "zero2-P3-blocking": dict(inner_strategy="zero2", fragments=3, overlap_steps=0),
             "cp2-P2-tau1": dict(cp=2, fragments=2, overlap_steps=1)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(STREAMING))
def test_streaming_grid_islands_equal_the_streaming_simulation(tmp_path, layout):
    """Streaming DiLoCo on 4 ranks, K = 2 islands of 2, H = 4, 6 steps: every step's loss equals
    test_diloco_streaming's one-process simulation (the whole model's cut; each fragment's outer step over the
    cross group on the rank's pieces of it), for tp 2, pp 2, ZeRO-2 and cp 2 islands. pp 2 with P = 4: each
    stage lacks a fragment (gpt-tiny's cut (0, 15), (15, 33), (33, 59), (59, 69) of 69 tensors), which it
    counts but does not exchange."""
    kw = STREAMING[layout]
    cfg = trainer_config(tmp_path / "run", strategy="diloco", nproc=4, islands=2, inner_steps=4, steps=6, **kw)
    got = train_losses(cfg)
    losses, _, _, left = simulate(cfg, 2, fragments=kw["fragments"], overlap=kw["overlap_steps"],
                                  alpha=kw.get("overlap_alpha", 0.5))
    assert close(got, losses), (got, losses)
    outer = shard(cfg.out, "island1-tp0-pp0" + ("-dp1" if "zero" in layout else ""))["outer"]
    # H = 4, 6 steps: fragment p's exchanges start after steps s with (s + 1 - p·4//P) % 4 == 0
    p_ = kw["fragments"]
    starts = [sum(1 for s in range(6) if (s + 1 - p * 4 // p_) % 4 == 0) for p in range(p_)]
    assert [f["syncs"] for f in outer["fragments"]] == [n - (p in left) for p, n in enumerate(starts)]
    assert sorted(e["fragment"] for e in outer["pending"]) == sorted(left)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_resumed_streaming_grid_run_equals_the_uninterrupted_one(tmp_path):
    """pp 2, P = 4, τ = 2, H = 4: stopped after step 3 with fragments 2 and 3 in flight (sent after steps 1 and
    2), of which stage 0 holds only 2, and resumed: every loss and every shard's state, bit for bit."""
    kw = dict(strategy="diloco", nproc=4, islands=2, inner_steps=4, pp=2, microbatches=2, fragments=4,
              overlap_steps=2)
    whole = tmp_path / "whole"
    ref = train_losses(trainer_config(whole, steps=6, **kw))
    out = tmp_path / "resumed"
    train_losses(trainer_config(out, steps=3, ckpt_every=3, **kw))
    pending = shard(out, "island0-tp0-pp0")["outer"]["pending"]
    assert [e["fragment"] for e in pending] == [2, 3] and pending[1]["mean"].numel() == 0  # (stage 0: none of 3)
    got = train_losses(trainer_config(out, steps=6, resume=True, **kw))
    assert got == ref
    for name in ("island0-tp0-pp0", "island1-tp0-pp1"):
        a, b = tensors(shard(out, name)), tensors(shard(whole, name))
        assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)), name


def tensors(tree) -> list[torch.Tensor]:
    """Every tensor of a nested state (dicts in key order, lists in order)."""
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in tensors(tree[k])]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in tensors(v)]
    return []


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,names", [("tp2", ("island0-tp0-pp0", "island1-tp1-pp0")),
                                          ("zero3", ("island0-tp0-pp0-dp0", "island1-tp0-pp0-dp1"))])
def test_a_resumed_run_equals_the_uninterrupted_one(tmp_path, layout, names):
    """Stopped after step 3 (between the syncs after steps 2 and 4) and resumed: every loss, and each shard's
    state (the grid's: tp shards, or ZeRO-3's flat shards and their inner optimizer state; the outer state)."""
    kw = dict(strategy="diloco", nproc=4, islands=2, inner_steps=2, **LAYOUTS[layout])
    whole = tmp_path / "whole"
    ref = train_losses(trainer_config(whole, steps=5, **kw))
    out = tmp_path / "resumed"
    train_losses(trainer_config(out, steps=3, ckpt_every=3, **kw))
    got = train_losses(trainer_config(out, steps=5, resume=True, **kw))
    assert got == ref  # the same computation on the same bits
    for name in names:
        a, b = tensors(shard(out, name)), tensors(shard(whole, name))
        assert len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b)), name
        assert shard(out, name)["outer"]["syncs"] == 2
    if layout != "tp2":
        return
    from distrain.errors import ConfigError
    from distrain.trainer.run_folder import check_resume

    with pytest.raises(ConfigError, match="was written with layout"):
        check_resume(trainer_config(out, steps=8, resume=True, **{**kw, "tp": 1, "inner_strategy": "zero2"}))
    with pytest.raises(ConfigError, match="--reshard: --strategy diloco's grid islands each hold their own state"):
        check_resume(trainer_config(out, steps=8, resume=True, reshard=True, **kw))
    from distrain.checkpoint.reshard import consolidate

    with pytest.raises(ConfigError, match="written by --strategy diloco with grid islands"):
        consolidate(out)  # (`distrain checkpoint consolidate`)


def test_the_island_axis_is_outermost_and_every_grid_group_stays_in_its_island():
    """Topology(islands=K): rank = island x M + the in-island rank; the grid's groups are each island's own, the
    cross groups join one place of every island; K = 1 is the grid it always was."""
    from distrain.topology import Topology

    t = Topology(1, 2, 1, islands=2, rank=3)
    assert t.per_island == 2 and t.island == 1 and t.tp_rank == 1
    assert t.groups_of("tp") == t.groups_of("island") == [[0, 1], [2, 3]]
    assert t.groups_of("cross") == [[0, 2], [1, 3]] and t.ranks_of("cross") == [1, 3]
    t = Topology(2, 1, 2, islands=2, rank=5)  # island 1 = ranks 4..7, a dp 2 x pp 2 grid
    assert t.groups_of("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]] and t.pp_next == 7 and t.pp_prev is None
    assert t.groups_of("dp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert t.groups_of("cross") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(8):
        assert t.rank_of(**t.coords_of(r)._asdict(), island=t.island_of(r)) == r
    plain = Topology(2, 1, 2, rank=3)
    assert plain.groups_of("pp") == [[0, 2], [1, 3]] and plain.island == 0 and plain.per_island == 4


GRID = dict(strategy="diloco", nproc=4, islands=2)
NOT_YET = "with --strategy diloco islands of --tp/--pp/--inner-strategy"


@pytest.mark.parametrize("kw,message", [
    (dict(GRID, tp=2), None),
    (dict(GRID, pp=2), None),
    (dict(GRID, inner_strategy="zero3"), None),
    (dict(GRID, islands=1, tp=2, inner_strategy="zero1"), None),  # one island: 2 replicas x tp 2
    (dict(GRID, islands=0, tp=2), "each of the 4 islands has --nproc / --islands = 1 rank(s)"),
    (dict(GRID, nproc=2, islands=0, tp=2), "each of the 2 islands has --nproc / --islands = 1 rank(s)"),
    (dict(GRID, tp=2, inner_strategy="zero1"), "it needs dp >= 2"),  # an island of tp 2 has dp 1
    (dict(GRID, dp=1, tp=2), "--dp 1 with --strategy diloco"),
    (dict(GRID, cp=2), None),
    (dict(GRID, cp=2, tp=2), "a cp x tp x pp = 4 grid does not divide"),
    (dict(GRID, tp=2, elastic="2:4"), "--elastic 2:4: with --tp/--pp only --strategy ddp is supported"),
    (dict(GRID, inner_strategy="zero2", elastic="2:4"), f"--elastic {NOT_YET}"),
    (dict(GRID, tp=2, layout_invariant=True), "--layout-invariant with --tp 2 needs --invariant-tp"),
    (dict(GRID, tp=2, layout_invariant=True, invariant_tp=True, units=4), None),
    (dict(GRID, inner_strategy="zero2", layout_invariant=True, units=4), None),
    (dict(GRID, tp=2, fragments=2), None),
    (dict(GRID, pp=2, fragments=4, overlap_steps=1, inner_steps=4), None),
    (dict(GRID, inner_strategy="zero2", overlap_steps=1), None),
    (dict(GRID, inner_strategy="zero3", fragments=2), None),
    (dict(GRID, inner_strategy="zero3", overlap_steps=1), None),
    (dict(GRID, tp=2, outer_compression="bf16"), None),
    (dict(GRID, tp=2, outer_compression="int8"), None),
    (dict(GRID, pp=2, outer_compression="int4"), None),
    (dict(GRID, inner_strategy="zero3", outer_compression="int8"), None),
    (dict(GRID, nproc=8, tp=2, inner_strategy="zero3", outer_compression="int4"), None),
    (dict(strategy="ddp", nproc=4, tp=2, inner_strategy="zero1"), "--inner-strategy applies only to --strategy "
                                                                  "diloco"),
])
def test_refusals(tmp_path, kw, message):
    assert_refused(trainer_config(tmp_path, **kw), message)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,compression", [("tp2", None), ("zero3", None), ("tp2", "bf16")])
def test_clipping_and_evaluation_equal_ddp_islands(tmp_path, layout, compression):
    """With --grad-clip (the island's whole-model norm: its tp shards or ZeRO shards summed over the island) and
    validation on θ_prev (the island's grid evaluation), K = 2 grid islands equal K = 2 DDP islands of 2 ranks
    (test_diloco's engine): every step's loss and the validation losses after steps 2 and 4; with Δ in bf16 on
    the wire too (elementwise: a shard's bf16 values are the whole model's, and two islands' sum is one add)."""
    from conftest import EVAL, assert_rows_equal, train_rows

    kw = dict(strategy="diloco", nproc=4, islands=2, inner_steps=2, grad_clip=0.05, outer_compression=compression,
              **EVAL)
    ref = train_rows(trainer_config(tmp_path / "ddp", **kw))
    got = train_rows(trainer_config(tmp_path / layout, **kw, **LAYOUTS[layout]))
    assert_rows_equal(got, ref)


# -- the quantized outer mean (int8/int4) on grid islands ---------------------------------------------------
def shard_pieces(meta: dict, names: list[str]) -> list[tuple[str, bool, object]]:
    """What one rank holds, in the outer step's order (engines/diloco_grid.py, ``outer_tensors``), read from
    its shard file: (whole tensor name, whether every tp rank holds it alike, the piece's elements as
    indices into the whole tensor's flattening, given its shape): its tp slice ([dim, start, stop] in
    ``tp``) or the whole tensor, and with ZeRO-3 the part of that in a flat shard (unit u's concatenated
    tensors, elements [d·S, (d + 1)·S) for dp rank d, S = ceil(N / dp), cut where its tensors meet).
    ``names``: the model's parameters in order (ZeRO-1/2's units hold them in reverse; the outer step, whole
    and in the module's order)."""
    tp = meta.get("tp", {})
    replicated = {local: local not in tp or tp[local][0] is None for local in meta["names"]}

    def elements(local: str, a: int = 0, b: int | None = None):
        def of(shape) -> torch.Tensor:
            i = torch.arange(math.prod(shape)).view(shape)
            if not replicated[local]:
                i = i.narrow(tp[local][0], tp[local][1], tp[local][2] - tp[local][1])
            return i.reshape(-1)[a:b]
        return of

    out = []
    if "zero" in meta and meta["zero"]["layout"]["stage"] == 3:
        z = meta["zero"]
        for unit in z["layout"]["units"]:
            S = -(-unit["numel"] // z["layout"]["world"])
            lo, hi, off = z["rank"] * S, (z["rank"] + 1) * S, 0
            for local, shape in zip(unit["names"], unit["shapes"]):
                n = math.prod(shape)
                a, b = max(lo, off) - off, min(hi, off + n) - off
                if a < b:
                    out.append((meta["names"][local], replicated[local], elements(local, a, b)))
                off += n
        return out
    if "order" in meta:
        held = meta["order"]
    else:  # ZeRO-1/2: the stage's whole parameters, its units' names, in the model's order
        place = {n: i for i, n in enumerate(names)}
        held = sorted((n for u in meta["zero"]["layout"]["units"] for n in u["names"]),
                      key=lambda n: place[meta["names"][n]])
    for local in held:
        out.append((meta["names"][local], replicated[local], elements(local)))
    return out


def island_shards(out, island: int) -> dict[str, dict]:
    """The shard files of one island: {shard name: its contents}."""
    from distrain import checkpoint

    manifest, shards = checkpoint.read_manifest(out), {}
    for file in manifest["files"]:  # checkpoint-{step:08d}-{shard}.pt
        name = file.split("-", 2)[2][:-len(".pt")]
        if name.startswith(f"island{island}-"):
            shards[name] = checkpoint.load_shard(out, manifest, name)
    return shards


def piece_means(out, bits: int, names: list[str], *, blocks_per_tensor: bool = True):
    """The simulation's quantized mean as the grid islands take it: each piece a rank of an island holds
    (:func:`shard_pieces`), the K islands' values of it through test_diloco_quantized's one-process quantized
    mean (blocks of 128 starting at the piece); a piece several ranks hold alike (a tensor replicated over
    tp, the dp replicas' stage with ZeRO-1/2) is the same piece on each. ``blocks_per_tensor`` False: the
    blocks run across the model's flat Δ instead (plain DiLoCo's), which the grid run must not match under
    tp."""
    from test_diloco_quantized import reference_mean

    pieces = [(name, elements) for meta in island_shards(out, 0).values()
              for name, _, elements in shard_pieces(meta, names)]

    def mean(deltas: list) -> list:
        if not blocks_per_tensor:
            flat = [torch.cat([d.reshape(-1) for d in ds]) for ds in deltas]
            m, out_, a = reference_mean(flat, bits), [], 0
            for d in deltas[0]:
                out_.append(m[a:a + d.numel()].view_as(d))
                a += d.numel()
            return out_
        by_name = [dict(zip(names, ds)) for ds in deltas]
        got = {n: torch.full_like(d, float("nan")) for n, d in by_name[0].items()}
        for name, elements in pieces:
            idx = elements(got[name].shape)
            flats = [island[name].reshape(-1)[idx] for island in by_name]
            got[name].view(-1)[idx] = reference_mean(flats, bits)
        assert not any(m.isnan().any() for m in got.values())  # the pieces cover every tensor
        return [got[n] for n in names]
    return mean


QUANTIZED = {"tp2-int8": dict(tp=2, outer_compression="int8"),
             "pp2-int4": dict(pp=2, microbatches=2, outer_compression="int4"),
             "zero2-int4": dict(inner_strategy="zero2", outer_compression="int4"),
             "zero3-int8": dict(inner_strategy="zero3", outer_compression="int8"),
             "tp2-zero3-int8": dict(nproc=8, tp=2, inner_strategy="zero3", outer_compression="int8")}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", list(QUANTIZED))
def test_quantized_outer_mean_on_grid_islands_equals_the_simulation(tmp_path, layout):
    """4 ranks, K = 2 islands of 2, H = 2, 5 steps, Δ in int8/int4: every step's loss equals test_diloco's
    one-process simulation whose outer mean quantizes the pieces the island's ranks hold (tp slices; a tensor
    every tp rank holds alike, whole; ZeRO-3's flat shards), and the outer parameters saved by the two tp ranks of
    a tensor replicated over tp (the final norm's weight) are equal: the replicas stay one. Under tp the
    simulation with plain DiLoCo's blocks across the flat Δ does not match (a run that cut its blocks so
    would fail here)."""
    kw = QUANTIZED[layout]
    cfg = trainer_config(tmp_path / "run", **{**dict(strategy="diloco", nproc=4, islands=2, inner_steps=2), **kw})
    got = train_losses(cfg)
    bits = {"int8": 8, "int4": 4}[kw["outer_compression"]]
    from distrain.models import build_model
    names = [n for n, _ in build_model(cfg.model).named_parameters()]
    losses, _, master, _ = simulate(cfg, 2, mean=piece_means(cfg.out, bits, names))
    assert close(got, losses), (got, losses)
    dp = "-dp1" if "zero" in layout else ""
    outer = shard(cfg.out, f"island1-tp0-pp0{dp}")["outer"]
    assert outer["syncs"] == 2
    if kw.get("tp"):  # the tp ranks' pieces of every tensor they hold alike are equal (norms, biases)
        shards = island_shards(cfg.out, 1)
        for name, a in shards.items():
            if "-tp0-" not in name + "-":
                continue
            b = shards[name.replace("-tp0", "-tp1")]
            pa, pb = shard_pieces(a, names), shard_pieces(b, names)
            alike = [i for i, (_, rep, _) in enumerate(pa) if rep]
            assert alike and [pa[i][0] for i in alike] == [pb[i][0] for i in alike]
            assert all(torch.equal(a["outer"]["master"][i], b["outer"]["master"][i]) for i in alike), name
        plain, _, _, _ = simulate(cfg, 2, mean=piece_means(cfg.out, bits, names, blocks_per_tensor=False))
        assert not close(got, plain), (got, plain)
