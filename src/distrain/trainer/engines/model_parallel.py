"""Model parallelism: ``--dp A --cp D --tp B --pp C`` (B, C or D > 1) on the dp × cp × tp × pp grid.

Every rank builds the same seeded full model; ``parallelize()`` applies tensor parallel
(tp group), context parallel (cp group), the pipeline split (pp group) and data parallel
(dp × cp group), in that order. Each data-parallel replica reads its slice of the global batch;
first-stage ranks feed the inputs, last-stage ranks the targets; with --cp each rank of the cp
group keeps its two chunks of every sequence (parallelize's ``split``).

The loss exists on the last stage (identical on its tp ranks): those ranks of tp rank 0
contribute loss / (dp × cp) -- each cp rank's loss is the mean over its equal share of the
tokens -- which sums over the world to the global batch's loss. Every (tp, pp) coordinate
holds a different shard: the rank with dp and cp rank 0 of each writes ``tp{t}-pp{p}``.

``--strategy zero1|zero2|zero3`` with --dp/--tp/--pp puts ZeRO over the dp group in place of
DDP (parallelize's ``zero_stage``): each dp rank then holds its own part of the (tp, pp)
shard's optimizer state (and gradients, and parameters), so every rank writes
``tp{t}-pp{p}-dp{d}`` (d: its rank in the dp × cp group); clipping takes the whole model's norm
over every rank's shards. Validation runs on every layout (``evaluate``: each replica its slice of every batch, through the
pipeline's forward-only schedule when pp > 1; every rank takes part); text sampling is not
done (the model is sharded).

``--ep N`` (a mixture of experts, parallel/expert_parallel): each rank of an ep group holds E/N of every
mixture layer's experts (parallelize's step 2b); the ranks i < N of the dp x cp group (i = dp_rank * cp
+ cp_rank: one per ep rank) write ``tp{t}-pp{p}-ep{r}``, each the non-expert parameters and its own
experts under their whole-model names, which consolidation joins by name.
"""

from __future__ import annotations

import torch

from distrain import comm
from distrain.topology import Topology
from distrain.models.outputs import logits_of
from distrain.trainer.engines.base import Engine, clip_coefficient, part_loss


class ModelParallelEngine(Engine):
    def __init__(self, cfg, model, loss_fn, optimizer_factory):
        from distrain.models.registry import model_cp_plan, model_ep_plan, model_tp_plan
        from distrain.parallel import parallelize

        super().__init__(cfg, model, loss_fn, optimizer_factory)
        self.zero_stage = zero_stage_of(cfg)
        self.topo = topo = Topology.from_world(dp=cfg.dp_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
        # the plan lives beside the model (models/gpt_plan.py, models/mlp_plan.py, models/hf/plan.py);
        # a user's model brings its own as ``model.tp_plan`` when tp > 1 (a Hugging Face model's
        # ``tp_plan`` is HF's, in HF's styles: model_tp_plan gives distrain's plan for it instead)
        plan = model_tp_plan(model)
        self.loss_fn = part_loss(loss_fn, cfg.batch_size, topo.dp, topo.dp_rank)  # (elastic: uneven replicas)
        self.pm = parallelize(model, topo, loss_fn=self.loss_fn, tp_plan=plan, algorithm=cfg.algorithm,
                              microbatches=cfg.microbatches, schedule=cfg.schedule,
                              bucket_cap_mb=cfg.bucket_cap_mb, zero_stage=self.zero_stage,
                              optimizer=optimizer_factory, cp_plan=model_cp_plan(model) if cfg.cp > 1 else None,
                              cp_algorithm=cfg.cp_algorithm, ep_plan=model_ep_plan(model))
        self.optimizer = self.pm.optimizer or optimizer_factory(self.pm.parameters())
        self.dp_rank, self.dp_size = topo.dp_rank, topo.dp
        self.loss_weight = 1.0 / (topo.dp * topo.cp) if (self.pm.has_loss and topo.tp_rank == 0) else 0.0
        self.label = (f"dp{topo.dp}×" + (f"cp{topo.cp}×" if topo.cp > 1 else "") + f"tp{topo.tp}×pp{topo.pp}"
                      + (f" {cfg.cp_algorithm}" if topo.cp > 1 else "") + (f" ep{topo.ep}" if topo.ep > 1 else "")
                      + (f" zero{self.zero_stage}" if self.zero_stage else ""))

    def train_step(self, x, y, commit=None):
        zero = self.pm.zero
        if zero is not None:
            zero.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            loss = self.pm.train_step(x, y)
        if self.cfg.grad_clip and zero is not None:
            # the whole model's norm: every rank's dp shard of its (tp, pp) shard, a tp-replicated
            # parameter counted on tp rank 0 only
            info, tp0 = self.pm.tp_info, self.topo.tp_rank == 0
            zero.clip_grad_norm_(self.cfg.grad_clip, count=lambda n: tp0 or info[n].dim is not None, whole_world=True)
        elif self.cfg.grad_clip:
            self._clip(self.cfg.grad_clip)
        if commit is not None:
            commit(loss)
        self.finish_step()
        self.comm_wait_s = self.pm.comm_wait_s
        return loss

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
        if not (c.trace or c.gantt) or self.pm.stage is None or self.topo.dp_rank or self.topo.tp_rank:
            return
        from distrain.parallel.pipeline_parallel import collect_timeline

        timeline = collect_timeline(self.pm.stage.timeline, group=self.topo.pp_group, dst=0)
        if timeline is None:
            return
        if c.trace:
            timeline.to_chrome_trace(c.trace)
        if c.gantt:
            timeline.plot_gantt(c.gantt, title=f"{self.label}, {c.schedule}, {c.microbatches} micro-batches, "
                                               f"last step")

    @torch.no_grad()
    def _clip(self, max_norm: float) -> None:
        """Clip by the norm of the WHOLE model's gradient: sum of squares over this rank's shard
        (a parameter replicated over the tp group, dim None, counted on tp rank 0 only), summed
        over the world and divided by dp x cp (the dp x cp ranks hold the same averaged gradients; an
        expert's are held by dp x cp / ep of them, so its squares count ep times)."""
        from distrain.parallel.tensor_parallel import tp_shard_info

        info = tp_shard_info(self.pm.module)
        experts = {id(p) for p in self.pm.expert_params or ()}
        grads = [(name, p.grad, self.topo.ep if id(p) in experts else 1)
                 for name, p in self.pm.module.named_parameters() if p.grad is not None]
        sq = torch.zeros((), dtype=torch.float64, device=grads[0][1].device if grads else None)
        for name, g, copies in grads:
            if info[name].dim is not None or self.topo.tp_rank == 0:
                sq += g.double().pow(2).sum() * copies
        comm.all_reduce(sq, op="sum", algorithm="native")
        coef = clip_coefficient(sq / (self.topo.dp * self.topo.cp), max_norm)
        for _, g, _ in grads:
            g.mul_(coef.to(g.dtype))

    def evaluate(self, batches):
        """What one process's ``evaluate_batches`` gives on the same ``batches`` -- {"val_loss": mean
        over batches of the batch's mean loss, and "val_accuracy" for a classifier} -- on every
        rank (equal in fp64 to rounding: a batch's loss is the mean of its micro-batches' mean
        losses). Collective: every rank calls it with the same batches (the loop's
        ``task.val_batches``).

        Each batch (B, ...) is cut into n = dp x m equal micro-batches (m = --microbatches: a
        training micro-batch's size, B / (dp m), so evaluation holds no more at once than a
        training forward); dp replica d runs micro-batches d*m .. d*m + m - 1 of every batch --
        through its pipeline with :func:`~distrain.parallel.pipeline_parallel.forward_only` when
        pp > 1, else through its (tp-sharded, or ZeRO-3-gathering) module -- in eval mode, without
        autograd, leaving the random generators and the last step's timeline as they were. The
        last stage's tp rank 0 scores each micro-batch as [loss, correct, counted] and one
        all-reduce over the world of the (batches, n, 3) float64 table, in which every entry has
        exactly one non-zero contributor (so the sum is exact), brings it to every rank. Every
        dp replica runs the same number of forwards (ZeRO-3's all-gathers need that). A batch
        that n does not divide is refused with a ConfigError (the trainer's always divide:
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
        xs, ys = [], []  # this replica's micro-batches, batch-major: (B/n, ...) each
        for b, (x, y) in enumerate(batches):
            if x.shape[0] % n or y.shape[0] != x.shape[0]:
                raise ConfigError(f"evaluate: validation batch {b} has {x.shape[0]} samples ({y.shape[0]} targets), "
                                  f"which dp {t.dp} x --microbatches {m} = {n} equal micro-batches cannot share; "
                                  f"use a --batch-size that {n} divides")
            xs += [pm.split(u, "input") for u in split_microbatches(x, n)[t.dp_rank * m:(t.dp_rank + 1) * m]]
            ys += [pm.split(u, "target") for u in split_microbatches(y, n, what="batch of targets")[
                t.dp_rank * m:(t.dp_rank + 1) * m]]

        # the unscaled loss (training's may carry part_loss's factor); a plan that keeps the output
        # sharded brings its own loss on shards (pm.loss_fn then calls it, unscaled)
        loss_fn = pm.loss_fn if sharded else self.eval_loss_fn

        def score(output, target):  # -> [mean loss, correct, counted] (3,) float64
            loss = loss_fn(output, target).detach().double()
            right = seen = torch.zeros((), dtype=torch.float64, device=loss.device)
            if accuracy and not target.is_floating_point():
                logits = logits_of(output)
                if logits.dim() == target.dim() + 1:  # class scores, as evaluate_batches counts them
                    right = (logits.argmax(dim=-1) == target).sum().double()
                    seen = torch.tensor(float(target.numel()), dtype=torch.float64, device=loss.device)
            return torch.stack([loss, right, seen])

        if pm.stage is None:
            with evaluation_mode(pm.module, self.device):  # ZeRO-3: the module holds no parameter
                rows = [score(pm.module(x), y) for x, y in zip(xs, ys)]
        else:
            s = pm.stage
            rows = forward_only(s, xs if s.is_first else None, ys if s.is_last else None,
                                score if s.is_last else None, num_microbatches=len(xs))
        table = torch.zeros(len(batches), n, t.cp, 3, dtype=torch.float64, device=self.device)
        if pm.has_loss and t.tp_rank == 0:  # the tp ranks of the last stage hold the same rows: one writes
            table[:, t.dp_rank * m:(t.dp_rank + 1) * m, t.cp_rank] = \
                torch.stack(rows).view(len(batches), m, 3).to(self.device)
        comm.all_reduce(table, op="sum", algorithm="native")  # one contributor per entry: exact
        losses = table[..., 0].mean(dim=2).mean(dim=1).tolist()  # mean over cp, then the n equal micro-batches
        out = {"val_loss": sum(losses) / len(losses)}
        right, seen = table[..., 1].sum().item(), table[..., 2].sum().item()
        if seen:
            out["val_accuracy"] = right / seen
        return out

    @classmethod
    def layout_of(cls, cfg) -> dict:
        z = zero_stage_of(cfg)
        return {"dp": cfg.dp_size, "tp": cfg.tp, "pp": cfg.pp, **({"cp": cfg.cp} if cfg.cp > 1 else {}),
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
        rows = [("micro-batches", f"{c.microbatches} ({c.schedule})")] if c.pp > 1 else []
        if self.pm.zero is not None:
            m = self.pm.zero.memory()
            rows.append(("held per rank (rank 0)", f"params {m['params'] / 1e6:.2f} MB, grads {m['grads'] / 1e6:.2f} "
                                                   f"MB, optimizer {m['optimizer'] / 1e6:.2f} MB"))
        return rows


def zero_stage_of(cfg) -> int:
    """--strategy zeroN -> N (ZeRO over the dp group), ddp -> 0."""
    return int(cfg.strategy.removeprefix("zero")) if cfg.strategy.startswith("zero") else 0
