"""The run folder (``--out``): a fresh run's checks, a resume's checks, and the checkpoints the loop writes and reads.

* :func:`check_out`: a fresh run needs an empty folder (``--overwrite`` removes the previous run's
  files: :data:`RUN_FILES`, nothing else);
* :func:`check_resume`: ``--resume`` finds a committed, verified checkpoint of the same model whose
  layout and continuation flags (:data:`CONTINUATION_FIELDS`) match, or ``--reshard``; all before any
  rank starts;
* :func:`save_checkpoint` / :func:`load_checkpoint`: collective, every rank its shard (distrain.checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from distrain import checkpoint
from distrain.checkpoint import init_from
from distrain.errors import ConfigError
from distrain.trainer.config import TrainConfig
from distrain.trainer.engines import Engine, engine_class

RUN_FILES = ("metrics.jsonl", "summary.json", "loss.png", "config.json", "data.json", "tokenizer.json", "tensorboard/*",
             checkpoint.MANIFEST, "checkpoint-*.pt", ".checkpoint*.tmp")


def check_out(cfg: TrainConfig, remove: bool = True) -> None:
    """A fresh run needs an empty --out (or --overwrite, which removes the previous run's files)."""
    out = Path(cfg.out)
    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder for the run's outputs")
    held = sorted(p.name for p in out.iterdir() if p.name != ".distrain.lock")  # the run lock (runlock.py)
    if not held:
        return
    if not cfg.overwrite:
        listed = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
        raise ConfigError(f"--out {out} is not empty ({listed}); pass --resume to continue that run, --overwrite to "
                          f"replace it, or choose another --out")
    for pattern in RUN_FILES if remove else ():
        for p in out.glob(pattern):
            p.unlink(missing_ok=True)


# flags whose change would make a resumed run differ from the uninterrupted one (--steps may grow)
CONTINUATION_FIELDS = ("data", "seq_len", "seed", "batch_size", "dtype", "optimizer", "lr", "weight_decay", "momentum",
                       "algorithm", "compression", "microbatches", "schedule", "max_staleness",
                       "inner_steps", "outer_optimizer", "outer_lr", "outer_momentum", "outer_compression",
                       "fragments", "overlap_steps", "overlap_alpha",
                       "layout_invariant", "invariant_tp")


def check_resume(cfg: TrainConfig) -> dict:
    """The committed checkpoint of ``cfg.out`` fits this run, or a one-line ConfigError."""
    manifest = checkpoint.read_manifest(cfg.out)
    checkpoint.verify(cfg.out, manifest)  # checksums, before any rank starts
    where = Path(cfg.out) / checkpoint.MANIFEST
    if manifest.get("model") != cfg.model:
        raise ConfigError(f"--resume: checkpoint {where} holds model {manifest.get('model')!r}, this run trains "
                          f"--model {cfg.model}; resume with the same --model or choose another --out")
    layout = engine_class(cfg).layout_of(cfg)
    if manifest["layout"] != layout and not cfg.reshard:
        raise ConfigError(f"--resume: checkpoint {where} was written with layout {manifest['layout']}, this run uses "
                          f"{layout}; resume with the same --dp/--tp/--pp (and --strategy, --nproc, --servers), or "
                          f"add --reshard to load it into this layout")
    if cfg.reshard and cfg.island_grid:
        raise ConfigError(f"--reshard: --strategy diloco's grid islands each hold their own state (and the outer "
                          f"state), not one model; resume without --reshard and with the layout {layout}")
    if cfg.reshard:
        ps = [s for s in (manifest.get("strategy"), cfg.strategy) if str(s).startswith("ps-")]
        if ps:
            raise ConfigError(f"--reshard: --strategy {ps[0]} keeps its state on parameter servers, which cannot be "
                              f"resharded; resume it without --reshard and with the same layout")
        first = checkpoint.load(Path(cfg.out) / manifest["files"][0])
        if manifest["layout"] != layout and "names" not in first and first.get("kind") is None:
            raise ConfigError(f"--reshard: {Path(cfg.out) / manifest['files'][0]} records no parameter names (written "
                              f"before distrain could reshard); resume it with its layout {manifest['layout']}")
    saved = manifest.get("config", {})
    # the pipeline's micro-batches and schedule belong to the layout: --reshard may change them
    fields = [f for f in CONTINUATION_FIELDS if not (cfg.reshard and f in ("microbatches", "schedule"))]
    changed = [f for f in fields if f in saved and saved[f] != getattr(cfg, f)]
    if changed:
        f = changed[0]
        raise ConfigError(f"--resume: --{f.replace('_', '-')} is {getattr(cfg, f)!r} but the checkpoint {where} was "
                          f"trained with {saved[f]!r}; a changed {', '.join(changed)} breaks exact continuation: resume "
                          f"with the same value or choose another --out")
    if int(manifest["step"]) > cfg.steps:
        raise ConfigError(f"--resume: checkpoint {where} is at step {manifest['step']}, past --steps {cfg.steps}")
    from distrain.trainer.task import check_resume_data

    check_resume_data(cfg)  # --data DIR of token shards: the same tokenizer as the run's (data.json)
    return manifest


def load_checkpoint(cfg: TrainConfig, engine: Engine) -> None:
    """Resume: this rank's part of the committed checkpoint of ``cfg.out``; a checkpoint of another
    layout (``--reshard``, which check_resume allowed) is consolidated and cut for this one."""
    out = Path(cfg.out)
    manifest = checkpoint.read_manifest(out)
    if manifest["layout"] != engine.layout:
        from distrain.checkpoint.reshard import consolidate

        engine.load_full(consolidate(out, manifest))
    elif engine.shard is not None:
        engine.load_state_dict(checkpoint.load_shard(out, manifest, engine.shard))


def save_checkpoint(cfg: TrainConfig, engine: Engine, step: int) -> None:
    """Collective: write this rank's shard (if it writes one); rank 0 commits the set."""
    state = engine.state_dict() if engine.writes_shard else None
    checkpoint.save_set(cfg.out, step, engine.layout, engine.shard if engine.writes_shard else None, state,
                        meta={"model": cfg.model, "strategy": cfg.strategy, "config": cfg.to_dict(),
                              **init_from.run_meta(cfg)})  # an hf:DIR model's config
