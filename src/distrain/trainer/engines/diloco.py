"""DiLoCo (``--strategy diloco``): islands of data-parallel ranks that synchronise every --inner-steps steps.

The world's P ranks form K = --islands islands of M = P / K consecutive ranks (0: K = P, every rank an
island; distrain.parallel.diloco). Every rank reads its own part of each global batch (dp rank = its
rank, dp size = P), so island i trains on the contiguous parts of its M ranks; inside an island our
DistributedDataParallel averages the gradients over its M ranks (when M > 1). Each island steps the run's
--optimizer (the inner optimizer, its state its own) every global step; after global steps s with
(s + 1) % H == 0 the islands take the outer step (OuterStep.sync: the averaged θ_prev − θ_island, then
SGD or Nesterov on θ_prev; every rank then holds θ_prev). The phase is the global step's, so a run
resumed at any step syncs where the uninterrupted one does.

The logged loss is the global batch's mean, each island's part on its own parameters. Validation and
the text sample use the outer parameters θ_prev (the model as of the last sync; after a sync every
island's). --lr and its schedule drive the inner optimizer; the outer learning rate is constant.

Streaming DiLoCo (--fragments P > 1 or --overlap-steps τ > 0; distrain.parallel.diloco.streaming): the
outer half is a StreamingOuter, an OuterStep per fragment, fragment p exchanged after global steps s with
(s + 1 − p·H//P) % H == 0 and, with τ > 0, applied τ steps later (merged with --overlap-alpha); one
fragment without overlap is DiLoCo's OuterStep itself (the same bits, the same checkpoint). Every step runs
inside its own traffic ledger: the summary's ``peak_step_bytes_rank0`` is the most this rank sent in one
step (with τ > 0 an exchange's bytes count in the step during which the comm thread sent them).

--layout-invariant (docs/determinism.md): the same bits whatever ranks each island has. The global batch's
U units are K islands' U / K each; island i's M ranks run its units one at a time as InvariantTraining's
replicas over the island group (int64 gradient sums, the exact-norm clip) instead of our DDP, so the island's
gradient is the island-on-one-rank's; the outer mean of Δ is an int64 sum at per-tensor exponents shared by
the islands (OuterStep's ``fixed_point``: distrain.parallel.diloco.exact), a function of the K deltas alone, in
plain and in Streaming DiLoCo. The logged loss: fsum of the islands' losses / K, on rank 0.

Elastic jobs (--elastic, plain DiLoCo; docs/fault_tolerance.md): with --islands 0 every live rank is an
island (K follows the world); with --islands K every rank stays in the island it started in
(parallel.diloco.live_islands: the group's ids against the job's starting ids, this rank's Member's), an
island of M_i live ranks reads part i of the K live islands' and cuts it among them, and the outer mean is
one all-reduce over the world to which each island's first rank alone brings Δ_i (_outer_share).

Checkpoints: one shard per island, ``island{i}``, written by the island's first rank: its replica
(parameters, buffers), its inner optimizer's state and the outer state (θ_prev, the outer optimizer's
momentum, the sync count; Streaming DiLoCo's per fragment, with the averaged Δ of every exchange still to
be applied), so a resume at any step, on or between syncs, continues exactly (a set holds K replicas). The layout records K and P (a resume needs the same).
"""

from __future__ import annotations

import contextlib
import copy
import time

import torch

from distrain.parallel.clip import clip_grad_norm
from distrain.parallel.data_parallel import DistributedDataParallel, accumulate_gradients
from distrain import comm
from distrain.data.sampler import part_bounds
from distrain.parallel.diloco import IslandGroups, OuterStep, StreamingOuter, live_islands
from distrain.parallel.diloco.exact import islands_mean
from distrain.trainer.engines.base import Engine, evaluate_batches, part_loss


def streams(cfg) -> bool:
    """Whether the job runs Streaming DiLoCo (--fragments > 1 or --overlap-steps > 0)."""
    return cfg.fragments > 1 or cfg.overlap_steps > 0


def outer_of(cfg, params, whole=None, **outer):
    """(streaming, the outer half) for ``params``: a StreamingOuter when it :func:`streams`
    (``whole``: StreamingOuter's cut of the whole model, for a rank holding pieces), else DiLoCo's OuterStep
    itself (its checkpoint format and bits unchanged); ``outer``: OuterStep's keywords."""
    if streams(cfg):
        return True, StreamingOuter(params, fragments=cfg.fragments, inner_steps=cfg.inner_steps,
                                    overlap_steps=cfg.overlap_steps, alpha=cfg.overlap_alpha, whole=whole, **outer)
    return False, OuterStep(params, **outer)


def stream_label(cfg) -> str:
    """The engine label's Streaming DiLoCo part (empty without it)."""
    return f", P={cfg.fragments}, τ={cfg.overlap_steps}" if streams(cfg) else ""


def islands_of(cfg) -> int:
    """K: --islands, or every rank its own island (0)."""
    return cfg.islands or cfg.nproc


def elastic_islands(cfg) -> list[list[int]]:
    """An elastic job's live islands (--islands K): each island's ranks in this group, every rank in the island
    it started in, a newcomer in the one it founded or joined (islands.live_islands, from the memberships of
    every epoch so far: this rank's Member's)."""
    from distrain.elastic.member import current

    return live_islands(cfg.islands, current().memberships())


class DiLoCoEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.model = model
        # an elastic job with --islands: the live islands, each rank in the one it started in (live_islands)
        runs = elastic_islands(cfg) if cfg.elastic and cfg.islands else None
        self.groups = g = IslandGroups.build(self.rank, self.world, islands_of(cfg)) if runs is None else \
            IslandGroups.build_live(self.rank, self.world, runs)
        self.net = model if (g.island_group is None or cfg.layout_invariant) else DistributedDataParallel(
            model, group=g.island_group, algorithm=cfg.algorithm, bucket_cap_mb=cfg.bucket_cap_mb)
        self.optimizer = optimizer_factory(self.model.parameters())  # the inner optimizer: this island's own
        outer = dict(group=g.cross_group, islands=g.islands, optimizer=cfg.outer_optimizer, lr=cfg.outer_lr,
                     momentum=cfg.outer_momentum, algorithm=cfg.algorithm, compression=cfg.outer_compression,
                     place=g.island, fixed_point=cfg.layout_invariant)
        self.streaming, self.outer = outer_of(cfg, self.model.parameters(), **outer)
        self.dp_rank, self.dp_size = self.rank, self.world
        self.loss_fn = part_loss(loss_fn, cfg.batch_size, self.dp_size, self.dp_rank)
        self.loss_weight = 1.0 / self.world
        self.invariant = None
        self.mine = slice(None)  # this rank's samples of the part it reads
        if runs is not None:
            self._live_islands(cfg)
        if cfg.layout_invariant:  # (validated: K divides the units, M ranks share an island's U / K)
            self._invariant_islands(cfg)
        m = self.ranks_per_island
        size = f"×{m}" if isinstance(m, int) else f" ({'+'.join(map(str, m))} ranks)"
        self.label = f"diloco (K={g.islands}{size}, H={cfg.inner_steps}{stream_label(cfg)})"
        self.outer_s = 0.0  # seconds this rank spent in outer steps
        # an elastic job's step (a commit hook given): the state of the step's start, copied on a step that takes
        # the outer step (its inner update and the outer all-reduce come before the commit), and the update
        # still to apply after the commit (finish_step)
        self.start: dict | None = None
        self.update = None
        self.peak_step_bytes = 0  # the most bytes this rank sent in one step (the step's ledger)

    def train_step(self, x, y, commit=None):
        """The inner step (forward/backward of this rank's part, the island's gradient average, clipping,
        the inner optimizer), then the outer step when the global step closes an interval of H."""
        with comm.ledger() as led:
            total = self._step(x, y, commit)
        self.peak_step_bytes = max(self.peak_step_bytes, led.bytes_sent())
        return total

    @property
    def ranks_per_island(self):
        """M, or with islands of different sizes (an elastic job's) each island's, in island order."""
        g = self.groups
        sizes = sorted({len(r) for r in g.runs}) if g.runs is not None else [g.per_island]
        return sizes[0] if len(sizes) == 1 else [len(r) for r in g.runs]

    def _live_islands(self, cfg) -> None:
        """An elastic job's islands (islands.live_islands: sizes may differ): island i of K reads part i of K of
        the global batch (dp part i of K: the simulation's), its M_i ranks contiguous slices of it (place j:
        part_bounds(n_i, M_i, j)), each rank's loss scaled by (its slice's size) · M_i / n_i · n_i · K / B, so
        that the island's DDP average is the gradient of its part's mean (times n_i · K / B, 1 when K divides
        B: the one-rank islands' scale) and the logged sum, weights 1 / (M_i · K), the global batch's mean."""
        g = self.groups
        self.dp_rank, self.dp_size = g.island, g.islands
        lo, hi = part_bounds(cfg.batch_size, g.islands, g.island)
        self.mine = slice(*part_bounds(hi - lo, g.per_island, g.place))
        # the slice's scale in the island's part, then the part's in the batch (each the function itself when 1)
        self.loss_fn = part_loss(part_loss(self.eval_loss_fn, hi - lo, g.per_island, g.place), cfg.batch_size,
                                 g.islands, g.island)
        self.loss_weight = 1.0 / (g.per_island * g.islands)

    def _invariant_islands(self, cfg) -> None:
        """--layout-invariant: island i's part of the global batch is its U / K units (global units
        i·U/K ..), read whole by each of its ranks (dp part i of K, in units); its M ranks run them as
        InvariantTraining's replicas over the island group (place j: units part_bounds(U/K, M, j)), so the
        island's gradient is the same bits on 1, 2 or 3 ranks. The logged loss: the islands' losses summed
        exactly (math.fsum) over the cross group, on rank 0 (weight 1, 0 elsewhere: x + 0 is x)."""
        from distrain.trainer.checks.invariant import units_of
        from distrain.trainer.engines.invariant import InvariantTraining

        g = self.groups
        per = units_of(cfg) // g.islands
        self.invariant = InvariantTraining(cfg, self.model, self.eval_loss_fn, replicas=g.per_island,
                                           replica=g.place, group=g.island_group, units=per,
                                           first_unit=g.island * per, forward_context=self.autocast)
        self.dp_rank, self.dp_size = g.island, g.islands
        self.part_unit = self.invariant.samples_per_unit
        self.mine = self.invariant.samples  # this place's samples
        self.loss_weight = 1.0 if self.rank == 0 else 0.0

    def _invariant_loss(self, x, y) -> torch.Tensor:
        """This place's units of its island's part (x, y), the island's gradient in ``.grad`` (exact-norm
        clipped); the global batch's mean loss: fsum over the islands' losses / K (the same bits anywhere)."""
        island = float(self.invariant.step(x[self.mine], y[self.mine], self.step_index))
        g = self.groups
        return islands_mean(island, g.island, g.islands, g.cross_group)

    def _step(self, x, y, commit):
        self.optimizer.zero_grad(set_to_none=True)
        if self.invariant is not None:
            total = self._invariant_loss(x, y)
        else:
            total = accumulate_gradients(self.net, self.loss_fn, x[self.mine], y[self.mine], 1,
                                         forward_context=self.autocast)
            if self.cfg.grad_clip:  # the island's ranks hold the same (averaged) gradients: no sum over ranks
                clip_grad_norm([(p.grad, 1) for p in self.model.parameters()], self.cfg.grad_clip)
        if commit is not None:
            return self._elastic_step(total, commit)
        self.optimizer.step()
        wait = 0.0
        if self.streaming:  # (its fragments' schedule: StreamingOuter.step)
            _, wait = self._timed(lambda: self.outer.step(self.step_index))
        elif (self.step_index + 1) % self.cfg.inner_steps == 0:
            _, wait = self._timed(self.outer.sync)
        # the step's wait on communication: the outer all-reduce's (an island of several ranks also waits on
        # its DDP, which is not measured here: None)
        self.comm_wait_s = wait if self.groups.island_group is None else None
        return total

    def _elastic_step(self, total, commit):
        """An elastic job's step (plain DiLoCo: elastic/spec.py; an island of several ranks has averaged its
        gradients in its DDP, so its ranks take the same updates). Between outer steps:
        the commit, then the inner update (a replica's order: a failure leaves the step's start, a completed
        commit lets this rank finish the step alone). On an outer step the commit comes last: the step's
        start is copied, the inner update taken, the islands' mean Δ all-reduced, and only then the commit,
        so that a commit completed anywhere proves that every rank holds the same mean (each finishes the
        step alone, ``finish_step``: the outer step); a failure before it (a lost island in the outer
        all-reduce) takes every survivor back to its copy of the step's start (``start_state``) and the step
        is redone by the survivors, the outer mean over the islands left: an island that lost its last rank
        never brings its inner progress since the last outer step (one that keeps a rank loses nothing)."""
        wait = 0.0
        if (self.step_index + 1) % self.cfg.inner_steps == 0:
            self.start = copy.deepcopy(self.state_dict())  # (the model, the inner and outer optimizers' states)
            self.optimizer.step()
            mean, wait = self._timed(lambda: self.outer.mean(self._outer_share()))
            self.update = lambda: self.outer.apply(mean)
        else:
            self.update = self.optimizer.step
        commit(total)
        self.finish_step()
        self.comm_wait_s = wait if self.groups.island_group is None else None
        return total

    def _outer_share(self) -> torch.Tensor:
        """What this rank brings to the outer all-reduce: its island's Δ_i, or zeros where only each island's
        first rank brings it (IslandGroups.leaders_only: the world's sum is then the K islands' sum)."""
        flat = self.outer.outer_gradient()
        return flat.zero_() if self.groups.leaders_only and self.groups.place != 0 else flat

    def _timed(self, outer_work):
        """(``outer_work()``'s result, its seconds), the seconds added to this rank's time in outer steps."""
        t0 = time.perf_counter()
        result = outer_work()
        wait = time.perf_counter() - t0
        self.outer_s += wait
        return result, wait

    def finish_step(self) -> None:
        """The update after the commit (elastic jobs): the inner step, or on an outer step the outer one."""
        update, self.update, self.start = self.update, None, None
        update()

    def start_state(self) -> dict:
        """The step's start: the copy taken before an outer step's inner update, else the live state."""
        return self.start if self.start is not None else self.state_dict()

    def _share_island_state(self) -> None:
        """An elastic job with --islands, after every rank loaded its state (collective over each island): the
        island's first rank sends its replica and inner optimizer state to the others, so that a newcomer
        that joined a live island holds the island's inner state (the survivors hold it already: the same
        bits; the first rank is always one of them, newcomers coming after the survivors)."""
        g = self.groups
        if g.runs is None or g.island_group is None:
            return
        first = g.runs[g.island][0]
        mine = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()} \
            if self.rank == first else None
        got = comm.broadcast_data(mine, src=first, group=g.island_group)  # (data only: tensors and containers)
        if self.rank != first:
            self.model.load_state_dict(got["model"])
            self.optimizer.load_state_dict(got["optimizer"])

    def load_newcomer(self, state: dict) -> None:
        """A newcomer's island (elastic jobs) from a live peer's state: the outer state (θ_prev, the outer
        momentum, the sync count: the same on every rank) and the peer's buffers; its parameters θ_prev and
        its inner optimizer fresh (this engine's, just built): it starts its inner phase from the outer
        parameters, as every island does after an outer step, and takes part from the next one on. With
        --islands a newcomer that joins a live island (islands.island_labels) then takes that island's replica
        and inner optimizer state from its first rank instead (_share_island_state): a replica like the others."""
        self.model.load_state_dict(state["model"])  # (the buffers; the parameters are θ_prev below)
        self.outer.load_state_dict(state.get("outer"), "a peer's state")
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.outer.master):
                p.copy_(m)
        self._share_island_state()  # (--islands: joining a live island, it takes the island's inner state)

    def end_training(self) -> None:
        """Every exchange still in flight completes (its mean waits for its step, or the checkpoint)."""
        if self.streaming:
            self.outer.settle()

    def optimizers(self):
        return [self.optimizer]  # the schedule drives the inner optimizer; the outer lr stays --outer-lr

    def buffers(self):
        return list(self.model.buffers())

    @contextlib.contextmanager
    def outer_parameters(self):
        """The model holding θ_prev inside the block, its own parameters again after it."""
        held = [p.detach().clone() for p in self.model.parameters()]
        with torch.no_grad():
            for p, m in zip(self.model.parameters(), self.outer.master):
                p.copy_(m)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for p, h in zip(self.model.parameters(), held):
                    p.copy_(h)

    def evaluate(self, batches):
        """The outer parameters' validation loss, on rank 0 (the same on every rank)."""
        if self.rank != 0:
            return None
        with self.outer_parameters() as net:
            return evaluate_batches(net, self.eval_loss_fn, batches, accuracy=self.cfg.data_kind != "text")

    @classmethod
    def layout_of(cls, cfg) -> dict:
        return {"dp": cfg.nproc, "tp": 1, "pp": 1, "islands": islands_of(cfg)}

    @property
    def layout(self) -> dict:
        """The live layout: an elastic job's K after an island was lost, not --islands."""
        return dict(self.layout_of(self.cfg), islands=self.groups.islands)

    @property
    def shard(self):
        return f"island{self.groups.island}"

    @property
    def writes_shard(self) -> bool:
        return self.groups.place == 0

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.outer.load_state_dict(state.get("outer"), f"shard {self.shard}")
        self._share_island_state()  # (an elastic job's --islands: a newcomer in the island loads at once)

    def report(self, ledger, steps: int) -> dict:
        c = self.cfg
        return {"islands": self.groups.islands, "ranks_per_island": self.ranks_per_island,
                "inner_steps": c.inner_steps, "outer_optimizer": c.outer_optimizer, "outer_lr": c.outer_lr,
                "outer_momentum": c.outer_momentum, "outer_compression": c.outer_compression,
                "outer_syncs": self.outer.syncs, "outer_s_rank0": self.outer_s, "fragments": c.fragments,
                "overlap_steps": c.overlap_steps, "overlap_alpha": c.overlap_alpha if c.overlap_steps else None,
                "fragment_params": self.outer.numels() if self.streaming else [sum(p.numel() for p in
                                                                                self.model.parameters())],
                "peak_step_bytes_rank0": self.peak_step_bytes}

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        s = summary
        comp = f", {s['outer_compression']} on the wire" if s.get("outer_compression") else ""
        m = s["ranks_per_island"]  # (an elastic job's islands of different sizes: a list)
        return [("islands", f"{s['islands']} × {m} rank(s)" if isinstance(m, int) else
                            f"{s['islands']} of {' + '.join(map(str, m))} ranks"),
                ("outer steps", f"{s['outer_syncs']} (every {s['inner_steps']} steps; {s['outer_optimizer']}, lr "
                                f"{s['outer_lr']:g}, momentum {s['outer_momentum']:g}{comp})")] + self.streaming_rows(s)

    @staticmethod
    def streaming_rows(s: dict) -> list[tuple[str, str]]:
        """Streaming DiLoCo's rows (the fragments, the overlap; none for plain DiLoCo), then the largest step's
        bytes (summaries written before it have none)."""
        rows = []
        if s.get("fragments", 1) > 1 or s.get("overlap_steps"):
            sizes = ", ".join(f"{n:,}" for n in s["fragment_params"])
            overlap = f"{s['overlap_steps']} step(s), merge α = {s['overlap_alpha']:g}" if s["overlap_steps"] else \
                "none (each exchange blocks)"
            rows += [("fragments", f"{s['fragments']} ({sizes} parameters), offset by {s['inner_steps']}/"
                                   f"{s['fragments']} steps; outer steps counted per fragment"),
                     ("overlap", overlap)]
        if "peak_step_bytes_rank0" in s:
            rows.append(("peak step bytes (rank 0)", f"{s['peak_step_bytes_rank0']:,} (the most sent in one step)"))
        return rows

    def sample_model(self):
        """A copy of the model holding the outer parameters (rank 0's)."""
        with self.outer_parameters() as net:
            return copy.deepcopy(net)
