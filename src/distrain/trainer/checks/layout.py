"""The layout: how many ranks, how they form the dp x cp x tp x pp (x ep) grid, whether the model
splits that way, and how the global batch divides among them."""

from __future__ import annotations

from distrain.trainer.checks.need import need
from distrain.trainer.choices import LOCAL_RANKS_PER_CORE, MODEL_DATA, VIRTUAL_STAGES, local_rank_limit


def check_local_ranks(cfg, launched: tuple[int, int] | None) -> None:
    """A local job (``launched`` None: this process spawns the ranks) runs at most LOCAL_RANKS_PER_CORE
    ranks per usable core; a launched rank is one of many machines' ranks, not limited here."""
    if launched is not None:
        return
    limit, cores = local_rank_limit()
    need(cfg.nproc <= limit,
         f"--nproc {cfg.nproc}: a local job runs at most {limit} ranks here ({LOCAL_RANKS_PER_CORE} per core, "
         f"{cores} usable core(s)). Each rank is a whole process (interpreter, model, threads) that must share "
         f"the cores: beyond that they start so slowly that the rendezvous times out (1000 ranks on 2 cores "
         f"ended after 2 minutes with a store time-out) and train no faster. Use --nproc {limit} or fewer, or "
         f"spread the ranks over machines: `distrain launch --nnodes M --node-rank R --nproc-per-node N "
         f"--rdzv-endpoint HOST:PORT train ...` on each")


def check_experts(cfg) -> None:
    """A mixture-of-experts preset and --ep against the layout (parallel/expert_parallel/sizes.py:
    check_ep_flags, one line each)."""
    from distrain.models import preset_config
    from distrain.parallel.expert_parallel import check_ep_flags

    moe = None if cfg.custom_model else preset_config(cfg.model).get("moe")
    check_ep_flags(cfg, moe)


def check_grid(cfg) -> None:
    """--cp-algorithm needs --cp > 1; --dp/--tp/--pp/--cp/--ep compose with ddp or zero1-3 (or diloco's islands:
    checks/diloco.py), their product is
    --nproc (Topology), and a ZeRO stage fits the grid (parallel/parallelize.py: check_zero_layout)."""
    need(cfg.cp > 1 or cfg.cp_algorithm == "ring",
         f"--cp-algorithm {cfg.cp_algorithm} chooses the attention across context-parallel ranks; with --cp "
         f"{cfg.cp} there are none: drop it, or give --cp 2 or more")
    if cfg.island_grid:
        return  # DiLoCo's islands, each a grid (checks/diloco.py: check_island_grid)
    if cfg.model_parallel or cfg.dp:
        from distrain.topology import Topology

        need(cfg.strategy == "ddp" or cfg.strategy.startswith("zero"),
             f"--dp/--tp/--pp{'/--cp' if cfg.cp > 1 else ''}{'/--ep' if cfg.ep > 1 else ''} compose with --strategy "
             f"ddp only, or with zero1/zero2/zero3 (ZeRO over the dp group); got {cfg.strategy}")
        Topology(dp=cfg.dp_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, world_size=cfg.nproc)  # product == nproc
        if cfg.strategy.startswith("zero") and cfg.model_parallel:
            from distrain.parallel.parallelize import check_zero_layout

            check_zero_layout(int(cfg.strategy[4:]), cfg.dp_size, cfg.pp, cfg.cp)


def check_preset_split(cfg) -> None:
    """A preset model split by --tp/--pp/--cp (your own model is checked once built: trainer/loop.py):
    a GPT or Llama, at most one stage per layer, tp dividing every size it splits, cp by the
    library's checks, --microbatches dividing the per-replica batch."""
    if not cfg.model_parallel or cfg.custom_model:
        return
    from distrain.models import preset_config
    from distrain.parallel.tensor_parallel.sizes import check_tp_divides

    need(MODEL_DATA[cfg.model] == "text", f"--tp/--pp/--cp split the GPT and Llama models; --model {cfg.model} "
                                          f"is not one")
    c = preset_config(cfg.model)
    n_layers = c["n_layer"] + 2  # embedding, blocks, head
    need(cfg.pp <= n_layers, f"--pp {cfg.pp}: {cfg.model} has {n_layers} layers (embedding, {c['n_layer']} "
                             f"blocks, head) but {cfg.pp} stages were asked for; use at most {n_layers}")
    # a Llama's grouped-query attention splits its KV heads too, and its SwiGLU hidden size: the library's
    # one size check, before any rank starts (the plans run it again on the built model)
    sizes = {k: c[k] for k in ("n_head", "n_kv_head", "n_embd", "intermediate_size", "vocab_size") if c.get(k)}
    check_tp_divides(cfg.tp, sizes, f"--model {cfg.model}")
    if cfg.cp > 1:
        _check_context_parallel(cfg, c)
    local = cfg.batch_size // max(1, cfg.dp_size)
    need(cfg.batch_size % cfg.dp_size == 0 and local % cfg.microbatches == 0,
         f"--microbatches {cfg.microbatches} does not divide the per-replica batch {cfg.batch_size} / "
         f"dp {cfg.dp_size} = {cfg.batch_size / cfg.dp_size:g}; pick a divisor of it")


def check_interleaved(cfg) -> None:
    """--schedule interleaved and --virtual-stages V (parallel/pipeline_parallel/interleaved.py): V >= 2
    chunks per rank on --pp >= 2 ranks, --microbatches a multiple of --pp (Megatron's groups of pp
    micro-batches per chunk), a preset with at least pp x V layers (your own model: the split refuses
    it once built); --virtual-stages other than its default only with that schedule."""
    if cfg.schedule != "interleaved":
        need(cfg.virtual_stages == VIRTUAL_STAGES,
             f"--virtual-stages {cfg.virtual_stages} applies to --schedule interleaved only (got --schedule "
             f"{cfg.schedule}); add --schedule interleaved or drop --virtual-stages")
        return
    v, pp, m = cfg.virtual_stages, cfg.pp, cfg.microbatches
    need(v >= 2, f"--virtual-stages must be >= 2 model chunks per pipeline rank, got {v}; use --virtual-stages 2 "
                 f"or more (one chunk per rank is --schedule 1f1b)")
    need(pp >= 2, f"--schedule interleaved spreads chunks of layers over pipeline ranks: it needs --pp >= 2, got "
                  f"--pp {pp}; add --pp 2 or more, or drop --schedule")
    need(m % pp == 0, f"--schedule interleaved runs micro-batches through each chunk in groups of --pp {pp}: "
                      f"--microbatches {m} must be a multiple of {pp}; use --microbatches {pp * max(1, m // pp)}")
    if cfg.custom_model:
        return
    from distrain.models import preset_config

    n_layers = preset_config(cfg.model)["n_layer"] + 2  # embedding, blocks, head
    need(pp * v <= n_layers,
         f"--pp {pp} x --virtual-stages {v} = {pp * v} chunks, but {cfg.model} has {n_layers} layers (embedding, "
         f"{n_layers - 2} blocks, head); use " + (f"--virtual-stages {n_layers // pp} or fewer" if n_layers // pp >= 2
                                                   else f"--pp {n_layers // 2} or fewer"))


def _check_context_parallel(cfg, c: dict) -> None:
    """--cp against a preset, by the library's own checks: 2 x cp divides the sequence (the block
    size); the all-to-all splits whole query and key/value heads per tp rank."""
    from distrain.parallel.context_parallel import check_cp_heads, check_length

    check_length(cfg.seq_len or c["block_size"], cfg.cp,
                 f"--seq-len {cfg.seq_len}" if cfg.seq_len else f"{cfg.model}'s sequence (block_size)")
    if cfg.cp_algorithm == "all-to-all":
        check_cp_heads(cfg.cp, {k: c[k] // cfg.tp for k in ("n_head", "n_kv_head") if c.get(k)}, cfg.model, cfg.tp)


def check_accumulation(cfg) -> None:
    """--accum-steps > 1: single, ddp or torch-ddp without a model-parallel layout, dividing the per-rank batch."""
    if cfg.accum_steps <= 1:
        return
    need(cfg.strategy in ("single", "ddp", "torch-ddp") and not cfg.model_parallel,
         f"--accum-steps applies to single, ddp and torch-ddp (pipelines accumulate over --microbatches; "
         f"parameter servers push every batch); got --strategy {cfg.strategy}"
         + (f" with --tp {cfg.tp} --pp {cfg.pp} --cp {cfg.cp}" if cfg.model_parallel else ""))
    per_rank = cfg.batch_size // max(1, cfg.workers)
    need(per_rank % cfg.accum_steps == 0,
         f"--accum-steps {cfg.accum_steps} does not divide the per-rank batch {cfg.batch_size} / "
         f"{cfg.workers} = {per_rank}; pick a divisor of it")


def check_batch(cfg) -> None:
    """The global batch divides among the data-parallel workers (an elastic job's parts may be uneven:
    exact all the same, engines' part_loss)."""
    need(cfg.batch_size % cfg.workers == 0 or cfg.elastic,
         f"--batch-size {cfg.batch_size} does not divide among {cfg.workers} data-parallel worker(s); use a "
         f"multiple of {cfg.workers}, e.g. {cfg.workers * max(1, round(cfg.batch_size / cfg.workers))}")
