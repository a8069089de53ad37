"""The grid engine: every layout of the dp × cp × tp × pp grid, with DDP or ZeRO over its data ranks.

``--strategy ddp`` and ``--strategy zero1|zero2|zero3``, alone or with ``--dp A --cp D --tp B --pp C
--ep E``, all run here: plain data parallelism is the grid with tp = pp = cp = 1. Every rank builds the
same seeded full model; ``parallelize()`` applies tensor parallel (tp group), context parallel (cp
group), expert parallel (ep group), the pipeline split (pp group) and data parallel (dp × cp group:
DDP, or ZeRO stage N), in that order. Each data-parallel replica reads its part of the global batch
(parts may differ by one sample in an elastic job: ``part_loss``); first-stage ranks feed the inputs,
last-stage ranks the targets; with --cp each rank of the cp group keeps its two chunks of every
sequence (parallelize's ``split``).

The loss exists on the last stage (identical on its tp ranks): those ranks of tp rank 0 contribute
loss / (dp × cp) -- each cp rank's loss is the mean over its equal share of the tokens -- which sums
over the world to the global batch's loss.

With ``--schedule interleaved`` the pp rank p holds --virtual-stages chunks of layers (chunk j on rank
j mod pp, parallelize's InterleavedStage), trained by ``interleaved_step`` and evaluated by ``forward_only``;
its shards are named as a plain stage's, their names in the whole model are the chunks' layers
(``stage_full_name``), and the layout records ``virtual_stages`` (so --reshard, not a plain resume, moves
such a run to or from another split).

Checkpoint shards, one naming for every layout: ``tp{t}-pp{p}`` (written by the rank with dp and cp
rank 0 of each (tp, pp) coordinate: the replicas hold the same), ``tp{t}-pp{p}-dp{d}`` with ZeRO (d: the
rank in the dp × cp group; every rank writes its own part), ``...-ep{r}`` with expert parallelism (the
ranks i < ep of the dp × cp group each write the non-expert parameters and their own experts under their
whole-model names). Runs written before the grid engine named ZeRO's shards ``zero-rank{r}``, with the
layout ``{"zero": N, "dp": P}``: the checkpoint reader maps both (checkpoint/store.py).

Clipping takes the whole model's norm (distrain.parallel.clip). Validation runs on every rank
(``evaluate``); text samples come from rank 0 when every rank holds the whole model.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.data.sampler import part_bounds
from distrain.parallel.clip import clip_grad_norm
from distrain.topology import Topology
from distrain.trainer.choices import zero_stage
from distrain.trainer.engines.base import Engine, part_loss, score


class GridEngine(Engine):
    """``islands`` K > 1: this grid is one of DiLoCo's K islands (engines/diloco_grid.py, which drives it): the
    Topology's groups lie inside this rank's island, replica d of island i reads part i·dp + d of K·dp of
    every batch, clipping and evaluation are the island's own, and the logged loss is weighted 1/K more. With
    --layout-invariant island i trains its U / K units (global units i·U/K ..: their dropout draws), each rank
    reading the island's part and running its replica's units of it, and the step's loss is the island's."""

    def __init__(self, cfg, model, loss_fn, optimizer_factory, islands: int = 1):
        from distrain.models.registry import model_cp_plan, model_ep_plan, model_tp_plan
        from distrain.parallel import parallelize

        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.zero_stage = zero_stage_of(cfg)
        self.topo = topo = Topology.from_world(dp=cfg.dp_size // islands, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep,
                                               islands=islands)
        # the plan lives beside the model (models/gpt/plan.py, models/llama/plan.py, ...); a user's model
        # brings its own as ``model.tp_plan`` when tp > 1 (a Hugging Face model's ``tp_plan`` is HF's, in
        # HF's styles: model_tp_plan gives distrain's plan for it instead)
        plan = model_tp_plan(model) if cfg.tp > 1 else None
        chunks = None
        if cfg.layout_invariant and cfg.invariant_tp:  # the plan on every layout, tp = 1 too: the canonical chunks
            from distrain.trainer.engines.invariant import invariant_tp_plan

            plan, chunks = invariant_tp_plan(cfg, model)
        # this replica's part of the global batch (islands: the K islands' dp replicas in island order)
        self.dp_rank, self.dp_size = topo.island * topo.dp + topo.dp_rank, topo.islands * topo.dp
        self.loss_fn = part_loss(loss_fn, cfg.batch_size, self.dp_size, self.dp_rank)  # (elastic: uneven replicas)
        self.pm = parallelize(model, topo, loss_fn=self.loss_fn, tp_plan=plan, algorithm=cfg.algorithm,
                              microbatches=cfg.microbatches, schedule=cfg.schedule,
                              virtual_stages=cfg.virtual_stages,
                              bucket_cap_mb=cfg.bucket_cap_mb, zero_stage=self.zero_stage,
                              optimizer=optimizer_factory, cp_plan=model_cp_plan(model) if cfg.cp > 1 else None,
                              cp_algorithm=cfg.cp_algorithm,
                              # layout-invariant: a mixture's router counts stay the unit's own (its balancing
                              # loss must not depend on which units share a rank)
                              ep_plan=None if cfg.layout_invariant else model_ep_plan(model),
                              compression=cfg.compression, tp_chunks=chunks)
        self.optimizer = self.pm.optimizer or optimizer_factory(self.pm.parameters())
        self.loss_weight = 1.0 / (topo.dp * topo.cp * topo.islands) if (self.pm.has_loss and topo.tp_rank == 0) \
            else 0.0
        # every rank holds the whole model and optimizer state (DDP replicas): an elastic job commits it as is
        self.whole = topo.tp == topo.pp == topo.cp == topo.ep == 1
        self.holds_whole_state = self.whole and not self.zero_stage
        self.label = label_of(cfg, topo, self.zero_stage)
        self.invariant = None
        self.mine = slice(None)  # --layout-invariant islands: this replica's samples of its island's part
        self._piece_meta = None  # (piece_state: the buffers' names and the naming record, made once)
        if cfg.layout_invariant:  # (validated: data parallelism; pipelines whose micro-batches are the units;
            # tensor parallelism under ddp)
            from distrain.trainer.checks.invariant import units_of
            from distrain.trainer.engines.invariant import InvariantTraining

            pm = self.pm  # the plan's own loss on its output (canonical chunks), else the model's
            loss = pm.loss_fn if pm.tp is not None and pm.tp_plan.loss is not None else self.eval_loss_fn
            # a DiLoCo island (islands > 1) trains its U / K units of the batch, global units i·U/K ..
            per = units_of(cfg) // topo.islands
            self.invariant = InvariantTraining(cfg, pm.module, loss, replicas=topo.dp,
                                               replica=topo.dp_rank, group=topo.dp_cp_group, zero=pm.zero,
                                               ddp=pm.ddp, forward_context=self.autocast,
                                               stage=pm.stage, pp_group=topo.pp_group if topo.pp > 1 else None,
                                               tp_group=topo.tp_group if topo.tp > 1 else None, tp_info=pm.tp_info,
                                               units=per, first_unit=topo.island * per)
            self.part_unit = self.invariant.samples_per_unit
            self.loss_weight = 1.0 if self.rank == 0 else 0.0  # every rank has the whole loss: exact
            if topo.islands > 1:  # each rank reads its island's part, and runs its replica's units of it
                self.dp_rank, self.dp_size = topo.island, topo.islands
                self.mine = self.invariant.samples

    def train_step(self, x, y, commit=None):
        """Forward/backward of this replica's part (``--accum-steps`` chunks without a pipeline,
        ``--microbatches`` through it), the gradient sync, clipping by the whole model's norm, ``commit``
        (an elastic job's quorum; with DDP its values ride in the last gradient bucket), the update."""
        pm, zero = self.pm, self.pm.zero
        if self.invariant is not None:
            loss = self.invariant.step(x[self.mine], y[self.mine], self.step_index)
            if commit is not None:
                commit(loss)
            self.finish_step()
            return loss
        if zero is not None:
            zero.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        ride = commit is not None and self.cfg.accum_steps == 1 and pm.can_carry
        with self.autocast():
            loss = pm.train_step(x, y, self.cfg.accum_steps, carry=commit.values if ride else None)
        if self.cfg.grad_clip:
            self.clip(self.cfg.grad_clip)
        if ride:
            commit.averaged(pm.ddp.carried())
        elif commit is not None:
            commit(loss)
        self.finish_step()
        self.comm_wait_s = pm.comm_wait_s
        return loss

    def clip(self, max_norm: float) -> float:
        """Clip by the norm of the WHOLE model's gradient (distrain.parallel.clip): a tp-replicated
        parameter (ShardInfo dim None) counted on tp rank 0 only, an expert's gradient (held by dp x cp / ep
        of the replicas) ep times; summed over the world and divided by the dp x cp replicas. With ZeRO each
        rank's flat shards, with the same counting. Replicas of the whole model need no sum."""
        pm, t = self.pm, self.topo
        tp0 = t.tp_rank == 0
        if pm.zero is not None:
            if self.whole:  # the dp group's shards are the whole model: ZeRO's own group
                return pm.zero.clip_grad_norm_(max_norm)
            info = pm.tp_info  # every shard of the island's grid (the world when islands is 1: None)
            return pm.zero.clip_grad_norm_(max_norm, count=lambda n: tp0 or info[n].dim is not None,
                                           group=t.island_group)
        if self.whole:
            return clip_grad_norm([(p.grad, 1) for p in pm.module.parameters()], max_norm)
        info = pm.tp_info
        experts = {id(p) for p in pm.expert_params or ()}
        terms = [(p.grad, (t.ep if id(p) in experts else 1) if (info[n].dim is not None or tp0) else 0)
                 for n, p in pm.module.named_parameters()]
        return clip_grad_norm(terms, max_norm, reduce=True, group=t.island_group, replicas=t.dp * t.cp)

    def finish_step(self) -> None:
        if self.pm.zero is not None:
            self.pm.zero.step()  # the optimizer on this rank's shards, then (stages 1-2) the all-gather
        else:
            self.optimizer.step()

    def buffers(self):
        return list(self.pm.module.buffers())

    def end_training(self) -> None:
        """--trace/--gantt: the last step's timeline of the pipeline that holds rank 0 (collective
        over its pp group), written by rank 0."""
        c = self.cfg
        if not (c.trace or c.gantt) or self.pm.stage is None or self.topo.dp_rank or self.topo.tp_rank or \
                self.topo.island:
            return
        from distrain.parallel.pipeline_parallel import collect_timeline

        timeline = collect_timeline(self.pm.stage.timeline, group=self.topo.pp_group, dst=0)
        if timeline is None:
            return
        if c.trace:
            timeline.to_chrome_trace(c.trace)
        if c.gantt:
            chunks = f" ({c.virtual_stages} chunks per rank)" if interleaved(c) else ""
            timeline.plot_gantt(c.gantt, title=f"{self.label}, {c.schedule}{chunks}, {c.microbatches} micro-batches, "
                                               f"last step")

    def evaluate(self, batches):
        """What one process's ``evaluate_batches`` gives on the same ``batches`` -- {"val_loss": mean
        over batches of the batch's mean loss, and "val_accuracy" for a classifier} -- on every
        rank (equal in fp64 to rounding). Collective: every rank calls it with the same batches (the
        loop's ``task.val_batches``).

        Each batch (B, ...) is cut into n = dp x m equal micro-batches (m = --microbatches: a
        training micro-batch's size, B / (dp m), so evaluation holds no more at once than a
        training forward); dp replica d runs micro-batches d*m .. d*m + m - 1 of every batch --
        through its pipeline with :func:`~distrain.parallel.pipeline_parallel.forward_only` when
        pp > 1, else through its (tp-sharded, or ZeRO-3-gathering) module -- in eval mode, without
        autograd, leaving the random generators and the last step's timeline as they were. When dp
        does not divide B (an elastic job's live replicas; m = 1) replica d runs its part
        (``part_bounds``), and a batch's loss weighs each part by its samples. The last stage's tp rank
        0 scores each micro-batch (``score``: [loss, correct, counted]) and one all-reduce over the
        world of the (batches, n, cp, 4) float64 table ([score, samples]), in which every entry has
        exactly one non-zero contributor (so the sum is exact), brings it to every rank. Every
        dp replica runs the same number of forwards (ZeRO-3's all-gathers need that). A batch
        that neither way can share is refused with a ConfigError (the trainer's always share:
        --microbatches divides batch_size / dp). Accuracy is left out when tp > 1 and the plan
        keeps the output sharded (its own loss on shards, e.g. the GPT's vocab-parallel logits).
        With --cp every rank of the cp group scores its chunks of the micro-batch (the mean over its
        equal share of the tokens) in its own column of the table, and a micro-batch's loss is the
        mean of the cp columns."""
        from distrain.errors import ConfigError
        from distrain.parallel.pipeline_parallel import evaluation_mode, forward_only, split_microbatches

        t, pm, m = self.topo, self.pm, self.cfg.microbatches
        sharded = t.tp > 1 and pm.tp_plan is not None and pm.tp_plan.loss is not None
        accuracy = self.cfg.data_kind != "text" and not sharded
        batches, n = list(batches), t.dp * m
        xs, ys, sizes = [], [], []  # this replica's micro-batches, batch-major: (B/n, ...) each
        for b, (x, y) in enumerate(batches):
            B = x.shape[0]
            if y.shape[0] != B or (B % n and (m > 1 or B < t.dp)):
                raise ConfigError(f"evaluate: validation batch {b} has {B} samples ({y.shape[0]} targets), "
                                  f"which dp {t.dp} x --microbatches {m} = {n} equal micro-batches cannot share; "
                                  f"use a --batch-size that {n} divides")
            if B % n:  # uneven replicas (m = 1): each its part
                lo, hi = part_bounds(B, t.dp, t.dp_rank)
                mine = [(x[lo:hi], y[lo:hi])]
            else:
                lo = t.dp_rank * m
                mine = list(zip(split_microbatches(x, n)[lo:lo + m],
                                split_microbatches(y, n, what="batch of targets")[lo:lo + m]))
            xs += [pm.split(u, "input") for u, _ in mine]
            ys += [pm.split(v, "target") for _, v in mine]
            sizes += [float(u.shape[0]) for u, _ in mine]

        # the unscaled loss (training's may carry part_loss's factor); a plan that keeps the output
        # sharded brings its own loss on shards (pm.loss_fn then calls it, unscaled)
        loss_fn = pm.loss_fn if sharded else self.eval_loss_fn

        def scored(output, target):
            return score(loss_fn, output, target, accuracy)

        if pm.stage is None:
            with evaluation_mode(pm.module, self.device):  # ZeRO-3: the module holds no parameter
                rows = [scored(pm.module(x), y) for x, y in zip(xs, ys)]
        else:
            s = pm.stage
            rows = forward_only(s, xs if s.is_first else None, ys if s.is_last else None,
                                scored if s.is_last else None, num_microbatches=len(xs))
        table = torch.zeros(len(batches), n, t.cp, 4, dtype=torch.float64, device=self.device)
        if pm.has_loss and t.tp_rank == 0:  # the tp ranks of the last stage hold the same rows: one writes
            got = torch.stack(rows).view(len(batches), m, 3).to(self.device)
            samples = torch.tensor(sizes, dtype=torch.float64, device=self.device).view(len(batches), m, 1)
            table[:, t.dp_rank * m:(t.dp_rank + 1) * m, t.cp_rank] = torch.cat([got, samples], dim=-1)
        # one contributor per entry: exact (islands: each island's own table, over its ranks)
        comm.all_reduce(table, op="sum", group=t.island_group, algorithm="native")
        per_mb = table[..., 0].mean(dim=2)  # (batches, n): a micro-batch's loss, the mean over its cp columns
        samples = table[:, :, 0, 3]
        losses = []
        for b in range(len(batches)):
            w = samples[b]
            even = bool((w == w[0]).all())  # equal micro-batches: the mean of their means
            losses.append((per_mb[b].mean() if even else (per_mb[b] * w).sum() / w.sum()).item())
        out = {"val_loss": sum(losses) / len(losses)}
        right, seen = table[..., 1].sum().item(), table[..., 2].sum().item()
        if seen:
            out["val_accuracy"] = right / seen
        return out

    @property
    def replica_group(self):
        """Our DDP's replicas: the dp x cp group of this rank's (tp, pp) shard (cp ranks hold the same
        parameters too); none with ZeRO (each holds a different shard) or --ep (different experts)."""
        return self.topo.dp_cp_group if not self.zero_stage and self.topo.ep == 1 else None

    def replica_state(self) -> list[torch.Tensor]:
        from distrain.trainer.replicas import optimizer_tensors

        return list(self.pm.module.parameters()) + optimizer_tensors(self.optimizer)

    @classmethod
    def layout_of(cls, cfg) -> dict:
        z = zero_stage_of(cfg)
        return {"dp": cfg.dp_size, "tp": cfg.tp, "pp": cfg.pp, **({"cp": cfg.cp} if cfg.cp > 1 else {}),
                **({"virtual_stages": cfg.virtual_stages} if interleaved(cfg) else {}),
                **({"ep": cfg.ep} if cfg.ep > 1 else {}),
                **({"zero": z} if z else {})}

    @property
    def shard(self):
        t = self.topo
        d = t.dp_rank * t.cp + t.cp_rank  # its rank in the dp x cp group, ZeRO's
        return f"tp{t.tp_rank}-pp{t.pp_rank}" + (f"-dp{d}" if self.zero_stage else "") + \
            (f"-ep{t.ep_rank}" if t.ep > 1 else "")  # (ep: each holds other experts; consolidate joins them by name)

    @property
    def writes_shard(self) -> bool:
        return self.topo.dp_rank * self.topo.cp + self.topo.cp_rank < self.topo.ep or self.zero_stage > 0

    def _names(self) -> dict[str, str]:
        """{name in this rank's module: name in the whole model} for what its checkpoint holds."""
        from distrain.checkpoint.reshard import stage_full_name, zero_names

        full = stage_full_name(self.pm.stage)
        if self.pm.zero is not None:
            return zero_names(self.pm.zero, full)
        return {n: full(n) for n in self.pm.module.state_dict()}

    def _order(self) -> list[str]:
        return [n for n, _ in self.pm.module.named_parameters()]

    def state_dict(self) -> dict:
        from distrain.checkpoint.reshard import shard_meta, stage_full_name, zero_shard_state

        if self.pm.zero is not None:
            return zero_shard_state(self.pm.zero, stage_full_name(self.pm.stage), self.pm.tp_info)
        return {"model": self.pm.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                **shard_meta(self._names(), self.pm.tp_info, self._order())}

    def piece_state(self) -> dict:
        """ZeRO: :meth:`state_dict`'s tree with the live shards and buffers (not copies) and the naming record
        and ZeRO layout made once per engine, as pieces.Fixed parts (an elastic job packs this every step: making
        the record, then walking it, cost more than the copy)."""
        zero = self.pm.zero
        if zero is None:
            return self.state_dict()
        if self._piece_meta is None:  # (the names and buffers kept are the engine's for its life)
            from distrain.elastic.pieces import Fixed

            full = self.state_dict()
            meta = {k: Fixed(v) for k, v in full.items() if k not in ("zero", "buffers")}  # (never walked: pieces.py)
            self._piece_meta = (list(full["buffers"]), meta, Fixed(full["zero"]["layout"]))
        kept, meta, layout = self._piece_meta
        live = dict(zero.module.named_buffers()) if kept else {}
        return {"zero": dict(zero.state_dict(copy=False), layout=layout), "buffers": {n: live[n].detach() for n in kept},
                **meta}

    def load_full(self, full: dict) -> None:
        from distrain.checkpoint.form import whole
        from distrain.checkpoint.reshard import load_plain, local_view

        view = local_view(full, self._names(), self.pm.tp_info)
        if self.pm.zero is not None:
            self.pm.zero.load_full_state_dict(whole(**view))
        else:
            load_plain(self.pm.module, self.optimizer, self._order(), view)

    def load_state_dict(self, state: dict) -> None:
        if self.pm.zero is not None:
            from distrain.checkpoint.reshard import load_zero_shard

            load_zero_shard(self.pm.zero, state)
            return
        self.pm.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def report(self, ledger, steps: int) -> dict:
        return {"layout": self.layout, "microbatches": self.cfg.microbatches, "schedule": self.cfg.schedule}

    def report_rows(self, summary: dict) -> list[tuple[str, str]]:
        c = self.cfg
        chunks = f", {c.virtual_stages} chunks per rank" if interleaved(c) else ""
        rows = [("micro-batches", f"{c.microbatches} ({c.schedule}{chunks})")] if c.pp > 1 else []
        if self.pm.zero is not None:
            m = self.pm.zero.memory()
            rows.append(("held per rank (rank 0)", f"params {m['params'] / 1e6:.2f} MB, grads {m['grads'] / 1e6:.2f} "
                                                   f"MB, optimizer {m['optimizer'] / 1e6:.2f} MB"))
        return rows

    def sample_model(self):
        """The whole model for text samples when every rank holds it (DDP replicas), else None."""
        return self.pm.module if self.holds_whole_state else None


def interleaved(cfg) -> bool:
    """Whether the run's pipeline is interleaved: each pp rank holds --virtual-stages chunks of layers (its
    checkpoint shards hold other layers than a plain stage's: the layout records the chunk count)."""
    return cfg.pp > 1 and cfg.schedule == "interleaved"


def zero_stage_of(cfg) -> int:
    """--strategy zeroN -> N (ZeRO over the dp x cp group), ddp -> 0."""
    return zero_stage(cfg.strategy)


def label_of(cfg, topo: Topology, zero_stage: int) -> str:
    """What the progress bar, plot and summary call the run: ``ddp (ring)`` / ``zero2 (ring)`` for plain
    data parallelism, else the grid, e.g. ``dp1×tp2×pp2`` or ``dp2×cp2×tp1×pp1 ring ep2 zero1``."""
    if topo.tp == topo.pp == topo.cp == topo.ep == 1:
        return f"{cfg.strategy} ({cfg.algorithm})"
    return (f"dp{topo.dp}×" + (f"cp{topo.cp}×" if topo.cp > 1 else "") + f"tp{topo.tp}×pp{topo.pp}"
            + (f" {cfg.cp_algorithm}" if topo.cp > 1 else "") + (f" ep{topo.ep}" if topo.ep > 1 else "")
            + (f" zero{zero_stage}" if zero_stage else ""))
