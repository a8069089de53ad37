"""--strategy diloco's own flags: --islands, --inner-steps, --outer-optimizer, --outer-lr, --outer-momentum,
--outer-compression, and Streaming DiLoCo's --fragments, --overlap-steps, --overlap-alpha (which other
strategies refuse: strategy.check_applies)."""

from __future__ import annotations

import math

from distrain.trainer.checks.need import need
from distrain.trainer.choices import OUTER_COMPRESSIONS, OUTER_OPTIMIZERS, zero_stage


def check_diloco(cfg) -> None:
    """H >= 1; --outer-lr > 0 and finite; --outer-momentum in [0, 1) (nesterov: > 0, as torch's SGD needs);
    known --outer-optimizer and --outer-compression; --islands in 0..nproc dividing --nproc."""
    if cfg.strategy != "diloco":
        return
    need(isinstance(cfg.inner_steps, int) and cfg.inner_steps >= 1,
         f"--inner-steps must be a whole number of steps >= 1, got {cfg.inner_steps!r}")
    need(cfg.outer_optimizer in OUTER_OPTIMIZERS,
         f"--outer-optimizer {cfg.outer_optimizer!r} is unknown; use {' or '.join(OUTER_OPTIMIZERS)}")
    need(cfg.outer_compression in (None,) + OUTER_COMPRESSIONS,
         f"--outer-compression {cfg.outer_compression!r} is unknown; use {' or '.join(OUTER_COMPRESSIONS)}")
    need(math.isfinite(cfg.outer_lr) and cfg.outer_lr > 0,
         f"--outer-lr must be a positive finite number, got {cfg.outer_lr}")
    need(math.isfinite(cfg.outer_momentum) and 0 <= cfg.outer_momentum < 1,
         f"--outer-momentum must be in [0, 1), got {cfg.outer_momentum}")
    need(cfg.outer_optimizer != "nesterov" or cfg.outer_momentum > 0,
         "--outer-optimizer nesterov needs --outer-momentum > 0 (Nesterov momentum without momentum is undefined); "
         "give --outer-momentum (0.9 is the paper's), or use --outer-optimizer sgd for plain averaging")
    need(isinstance(cfg.islands, int) and 0 <= cfg.islands <= cfg.nproc,
         f"--islands must be in 0..--nproc {cfg.nproc} (0: every rank an island), got {cfg.islands!r}")
    need(cfg.islands == 0 or cfg.nproc % cfg.islands == 0,
         f"--islands {cfg.islands} does not divide --nproc {cfg.nproc} into equal islands; use a divisor of "
         f"{cfg.nproc}")
    check_streaming(cfg)
    check_island_grid(cfg)


def check_island_grid(cfg) -> None:
    """Islands that are grids (--tp/--pp/--cp/--inner-strategy zeroN: engines/diloco_grid.py): each island's
    --nproc / K ranks a whole dp x cp x tp x pp grid (island dp = --nproc / (K x cp x tp x pp); --dp and --ep
    are not island axes yet), a ZeRO stage that fits it, and none of what the grid islands do not do yet (elastic
    islands, --layout-invariant with --pp), each refused by name."""
    if not cfg.island_grid:
        return
    k = cfg.islands or cfg.nproc
    m = cfg.nproc // k
    need(cfg.dp == 0, f"--dp {cfg.dp} with --strategy diloco: an island's dp is --nproc / (--islands x --cp x --tp x "
                      f"--pp), not given; drop --dp and choose --islands")
    need(cfg.ep == 1, f"--ep {cfg.ep} with --strategy diloco: an island's grid is dp x cp x tp x pp for now; drop "
                      f"--ep, or train with --strategy ddp")
    mp = cfg.tp * cfg.pp * cfg.cp
    need(m % mp == 0,
         f"--tp {cfg.tp} --pp {cfg.pp}{f' --cp {cfg.cp}' if cfg.cp > 1 else ''} with --strategy diloco: each of the "
         f"{k} islands has --nproc / --islands = {m} rank(s), which a {'cp x ' if cfg.cp > 1 else ''}tp x pp = {mp} "
         f"grid does not divide; give --islands K with --nproc / K a multiple of {mp}")
    need(not cfg.elastic, f"--elastic with --strategy diloco islands of --tp/--pp/--inner-strategy "
                          f"{cfg.inner_strategy} is not supported (DDP islands only); drop --elastic (elastic islands "
                          f"are DDP islands), or use DDP islands (no --tp/--pp, --inner-strategy ddp)")
    if cfg.layout_invariant:
        need(cfg.pp == 1, "--layout-invariant with --strategy diloco islands of --pp is not supported (islands of "
                          "--tp with --invariant-tp, of --inner-strategy zero1/zero2/zero3 or of DDP are); drop --pp")
    stage = zero_stage(cfg.inner_strategy)
    if cfg.layout_invariant and stage == 3:
        from distrain.trainer.checks.invariant import units_of

        per, dp = units_of(cfg) // k, m // mp
        need(per % dp == 0,
             f"--layout-invariant with --strategy diloco islands of --inner-strategy zero3: every replica of an "
             f"island must run the same number of units (its all-gathers are collective), so the island's {dp} "
             f"replicas must divide its --units / --islands = {per} units; use --units {k * dp * max(1, per // dp)}")
    if stage:
        from distrain.parallel.parallelize import check_zero_layout

        check_zero_layout(stage, m // mp, cfg.pp, cfg.cp)


def check_streaming(cfg) -> None:
    """--fragments >= 1 and at most the model's parameter tensors (a preset's or a Hugging Face model's,
    counted on the meta device; your factory's model is checked when built); --overlap-steps in 0..H-1, not
    with the quantized means (int8/int4 are not asynchronous); --overlap-alpha in [0, 1] (it acts with
    --overlap-steps only; alone it is unused, as test_trainer's one-flag-at-a-time rule needs)."""
    need(isinstance(cfg.fragments, int) and cfg.fragments >= 1,
         f"--fragments must be >= 1 (1: all parameters synchronise together), got {cfg.fragments!r}")
    need(isinstance(cfg.overlap_steps, int) and 0 <= cfg.overlap_steps < cfg.inner_steps,
         f"--overlap-steps must be in 0..--inner-steps - 1 = {cfg.inner_steps - 1} (an exchange is applied before "
         f"the fragment's next one starts), got {cfg.overlap_steps!r}")
    need(math.isfinite(cfg.overlap_alpha) and 0 <= cfg.overlap_alpha <= 1,
         f"--overlap-alpha must be in [0, 1], got {cfg.overlap_alpha}")
    need(cfg.overlap_steps == 0 or cfg.outer_compression not in ("int8", "int4"),
         f"--overlap-steps {cfg.overlap_steps} with --outer-compression {cfg.outer_compression}: the quantized mean "
         f"is two blocking exchanges, not one asynchronous all-reduce; use --outer-compression bf16 or none, or "
         f"--overlap-steps 0")
    if cfg.fragments > 1:
        from distrain.checkpoint.models import is_hf_name

        if cfg.custom_model and not is_hf_name(cfg.model):
            return  # (built by your factory on every rank: StreamingOuter refuses too many fragments there)
        tensors = parameter_tensors(cfg)
        need(cfg.fragments <= tensors,
             f"--fragments {cfg.fragments}: --model {cfg.model} has {tensors} parameter tensors and a fragment holds "
             f"whole tensors; use at most {tensors}")


def parameter_tensors(cfg) -> int:
    """How many parameter tensors the model ``cfg.model`` names has, built on the meta device."""
    from distrain.checkpoint import init_from
    from distrain.models.meta import shapes_only

    with shapes_only():
        model = init_from.build_model(cfg)
    return sum(1 for _ in model.parameters())
