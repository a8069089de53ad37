"""DiLoCo whose islands are grids (``--strategy diloco`` with --tp/--pp/--cp or --inner-strategy zero1-3).

The world's P ranks form K = --islands islands of M = P / K consecutive ranks (0: K = P), and each island
is a whole dp x cp x tp x pp grid of its own (island dp = M / (cp x tp x pp); Topology's ``islands`` axis, outermost:
rank = island x M + the rank inside the island). The inner step is the grid engine's step on the island's
grid (:class:`~distrain.trainer.engines.grid.GridEngine` built with ``islands=K``: tensor parallel, the
pipeline, DDP or ZeRO stage N over the island's dp group, clipping by the island's whole-model norm, the
inner optimizer, its state sharded inside the island with ZeRO). Island i's dp replica d reads part
i x dp + d of K x dp of every global batch, so island i trains on the contiguous parts of its replicas, as
plain DiLoCo's islands do.

The outer step (:class:`~distrain.parallel.diloco.OuterStep`) runs on what THIS rank holds: its module's
parameters (its tp shard of its pipeline stage; with ZeRO-1/2 the whole stage, which the shards are views
of), or with ZeRO-3 its flat shards cut where their parameters meet (``outer_tensors``: views, one piece of
one parameter each), over the ``cross`` group: the ranks with this rank's coordinates in every island, which
hold the same pieces. θ_prev and the outer momentum are per local piece. After
global steps s with (s + 1) % H == 0: the islands' mean of θ_prev − θ_i, the outer SGD/Nesterov step on
θ_prev, θ_i ← θ_prev (every rank of every island then holds θ_prev's shard).

The logged loss: the grid's, each island's weighted 1/K (the global batch's mean, each island's part on
its own parameters). Validation runs the island's grid evaluation on θ_prev (the same on every island).

Checkpoints: each island writes its grid's shards, named ``island{i}-`` + the grid's name (``tp{t}-pp{p}``,
``...-dp{d}`` with ZeRO), each with the outer state of the parameters it holds; a resume needs the same
layout (K, the island's dp, tp, pp, the ZeRO stage): --reshard is refused (the base engine's load_full).

--outer-compression bf16: Δ travels in bfloat16, as in plain DiLoCo (elementwise, so the same on shards).
int8/int4: the quantized mean of what this rank holds over the cross group, with each held tensor (a tp slice,
or a tensor every tp rank holds alike) starting a new block of 128 (OuterStep's ``tensor_blocks``): a
replicated tensor is rounded with the same scales on every tp rank, so its copies stay one, and each element's
mean depends on the K islands' values of its own piece (the one-process simulation quantizes the same pieces:
tests/test_diloco_grid.py). The blocks follow the layout (a tp slice is cut where plain DiLoCo's blocks are
not), so an int8 run of tp 2 islands is not bit for bit a run of DDP islands: both round to 8 bits, in
different blocks.

Streaming DiLoCo (--fragments P, --overlap-steps τ): a StreamingOuter on the held pieces with the whole
model's cut (``whole_index``: each piece's whole-model parameter name, a stage's ``layers.i`` the model's
``layers.{start+i}``), so fragment p on this rank is the plain engine's fragment p restricted to what it
holds (with ZeRO-3: the pieces of its flat shards that lie in fragment p's parameters), and each fragment's
outer step over the cross group is the one-process simulation's on these pieces.

--layout-invariant (islands of ZeRO-1/2/3 over the island's dp ranks, or of --tp with --invariant-tp, which
routes islands of one rank here too: the canonical tensor-parallel layers): each island trains its U / K units
as InvariantTraining's replicas (GridEngine), the logged loss is the islands' summed exactly
(``islands_loss``), and the outer mean is OuterStep's fixed-point sum with each exponent the whole tensor's
(``tensors``: tp slices, ZeRO-3's pieces), so a run is bit for bit the run of islands of one rank
(tests/test_diloco_invariant.py).

Not here (refused by the config, checks/diloco.py): elastic islands; --layout-invariant with --pp; --ep/--dp
inside an island.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch

from distrain.errors import ConfigError
from distrain.parallel.diloco.exact import islands_mean
from distrain.trainer.engines.base import Engine
from distrain.trainer.engines.diloco import DiLoCoEngine, islands_of, outer_of, stream_label, streams
from distrain.trainer.engines.grid import GridEngine, zero_stage_of


class DiLoCoGridEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        super().__init__(cfg, model, loss_fn, optimizer_factory)
        k = islands_of(cfg)
        whole = [(n, p.numel()) for n, p in model.named_parameters()]  # (before parallelize shards the model)
        # the island's grid: the grid engine of the inner strategy (ddp or zeroN) on K islands
        self.grid = g = GridEngine(dataclasses.replace(cfg, strategy=cfg.inner_strategy), model, loss_fn,
                                   optimizer_factory, islands=k)
        t = g.topo
        # what the outer step runs on: this rank's pieces of the model's tensors, each in one tensor
        self.held, names = self.outer_tensors()
        outer = dict(group=t.cross_group, islands=k, optimizer=cfg.outer_optimizer, lr=cfg.outer_lr,
                     momentum=cfg.outer_momentum, algorithm=cfg.algorithm, place=t.island,
                     compression=cfg.outer_compression, tensor_blocks=True, fixed_point=cfg.layout_invariant)
        index = self.whole_index(whole, names) if streams(cfg) or cfg.layout_invariant else None
        if cfg.layout_invariant:  # each exponent the whole tensor's (streaming: each fragment's OuterStep)
            outer["tensors"] = (len(whole), index[1])
        self.streaming, self.outer = outer_of(cfg, self.held, whole=index if streams(cfg) else None, **outer)
        self.dp_rank, self.dp_size, self.loss_weight = g.dp_rank, g.dp_size, g.loss_weight
        self.optimizer = g.optimizer
        self.label = f"diloco (K={k}×{t.per_island}: {g.label}, H={cfg.inner_steps}{stream_label(cfg)})"
        self.outer_s = 0.0  # seconds this rank spent in outer steps

    def outer_tensors(self) -> tuple[list[torch.Tensor], list[str]]:
        """(what the outer step runs on, each one's stage-local parameter name): the module's parameters (its
        tp shards of its stage; with ZeRO-1/2 the stage's whole parameters, which the shards are views of), or
        with ZeRO-3 the pieces of this rank's flat shards that lie in one parameter each: views, so the outer
        step writes through them into the shards (a shard's padding lies in none and stays zero). A piece of
        one tensor each is what Streaming DiLoCo's fragments (whole tensors) and the quantized mean's blocks
        (one tensor each: a tensor every tp rank holds alike sits at the same place in each tp rank's shard,
        the units having the same shapes) need."""
        g = self.grid
        if g.zero_stage != 3:
            named = list(g.pm.module.named_parameters())
            return [p for _, p in named], [n for n, _ in named]
        zero, tensors, names = g.pm.zero, [], []
        for unit, shard in zip(zero.units, zero.parameters()):
            lo, hi = unit.shard_range(zero.rank)
            for name, shape, off in zip(unit.names, unit.shapes, unit.offsets):
                a, b = max(lo, off), min(hi, off + shape.numel())
                if a < b:  # (this rank's elements a..b of the unit's flat, of parameter ``name``)
                    tensors.append(shard.detach()[a - lo:b - lo])
                    names.append(name)
        return tensors, names

    def whole_index(self, whole: list[tuple[str, int]], names: list[str]) -> tuple[list[int], list[int]]:
        """(the whole model's tensor sizes, each held tensor's index among them): the held tensors by their
        whole-model names (``names`` local; a pipeline stage's ``layers.i`` is the model's ``layers.{start+i}``),
        so that Streaming DiLoCo's fragments are the plain engine's cut of the whole model (fragment_cuts)."""
        from distrain.checkpoint.reshard import stage_full_name

        full, where = stage_full_name(self.grid.pm.stage), {n: i for i, (n, _) in enumerate(whole)}
        index = []
        for n in names:
            if full(n) not in where:
                raise ConfigError(f"--fragments: this rank's parameter {full(n)!r} is not one of the model's "
                                  f"parameters, so it has no fragment; use --fragments 1 --overlap-steps 0")
            index.append(where[full(n)])
        return [size for _, size in whole], index

    def train_step(self, x, y, commit=None):
        """The island's grid step (its inner optimizer's update included), then the outer step when the global
        step closes an interval of H."""
        self.grid.step_index = self.step_index
        loss = self.grid.train_step(x, y)
        if self.grid.invariant is not None:
            loss = self.islands_loss(loss)
        t0 = time.perf_counter()
        if self.streaming:  # (its fragments' schedule: StreamingOuter.step)
            self.outer.step(self.step_index)
        elif (self.step_index + 1) % self.cfg.inner_steps == 0:
            self.outer.sync()
        self.outer_s += time.perf_counter() - t0
        self.comm_wait_s = None  # (the grid's waits and the outer all-reduce: not one measure)
        return loss

    def islands_loss(self, island: torch.Tensor) -> torch.Tensor:
        """--layout-invariant: the global batch's mean loss from the islands' (each the same on every rank of
        its island), summed exactly (math.fsum) over the cross group and divided by K, as plain DiLoCo's
        invariant islands do: the same bits on any layout."""
        t = self.grid.topo
        return islands_mean(float(island), t.island, t.islands, t.cross_group)

    def optimizers(self):
        return self.grid.optimizers()  # the schedule drives the inner optimizer; the outer lr stays --outer-lr

    def buffers(self):
        return self.grid.buffers()

    def end_training(self) -> None:
        self.grid.end_training()
        if self.streaming:
            self.outer.settle()  # (every exchange still in flight completes; its mean waits for its step)

    @contextlib.contextmanager
    def outer_parameters(self):
        """What this rank holds set to θ_prev inside the block, its own values again after it."""
        kept = [p.detach().clone() for p in self.held]
        with torch.no_grad():
            for p, m in zip(self.held, self.outer.master):
                p.copy_(m)
        try:
            yield
        finally:
            with torch.no_grad():
                for p, h in zip(self.held, kept):
                    p.copy_(h)

    def evaluate(self, batches):
        """The outer parameters' validation loss: the island's grid evaluation on θ_prev (collective over the
        island; every island computes the same)."""
        with self.outer_parameters():
            return self.grid.evaluate(batches)

    @classmethod
    def layout_of(cls, cfg) -> dict:
        k = islands_of(cfg)
        z = zero_stage_of(dataclasses.replace(cfg, strategy=cfg.inner_strategy))
        return {"dp": cfg.nproc // (k * cfg.tp * cfg.pp * cfg.cp), "tp": cfg.tp, "pp": cfg.pp,
                **({"cp": cfg.cp} if cfg.cp > 1 else {}), "islands": k, **({"zero": z} if z else {})}

    @property
    def shard(self):
        return f"island{self.grid.topo.island}-{self.grid.shard}"

    @property
    def writes_shard(self) -> bool:
        return self.grid.writes_shard

    def state_dict(self) -> dict:
        return {**self.grid.state_dict(), "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.grid.load_state_dict({k: v for k, v in state.items() if k != "outer"})
        self.outer.load_state_dict(state.get("outer"), f"shard {self.shard}")

    def report(self, ledger, steps: int) -> dict:
        c, t = self.cfg, self.grid.topo
        return {"islands": t.islands, "ranks_per_island": t.per_island, "island_grid": self.grid.label,
                "inner_strategy": c.inner_strategy, "inner_steps": c.inner_steps,
                "outer_compression": c.outer_compression,
                "outer_optimizer": c.outer_optimizer, "outer_lr": c.outer_lr, "outer_momentum": c.outer_momentum,
                "outer_syncs": self.outer.syncs, "outer_s_rank0": self.outer_s, "fragments": c.fragments,
                "overlap_steps": c.overlap_steps, "overlap_alpha": c.overlap_alpha if c.overlap_steps else None,
                "fragment_params": self.outer.numels() if self.streaming else [sum(p.numel() for p in self.held)]}

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        s = summary
        return [("islands", f"{s['islands']} × {s['ranks_per_island']} rank(s), each {s['island_grid']}"),
                ("outer steps", f"{s['outer_syncs']} (every {s['inner_steps']} steps; {s['outer_optimizer']}, lr "
                                f"{s['outer_lr']:g}, momentum {s['outer_momentum']:g})")] + \
            DiLoCoEngine.streaming_rows(s)
