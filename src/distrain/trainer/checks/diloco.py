"""--strategy diloco's own flags: --islands, --inner-steps, --outer-optimizer, --outer-lr, --outer-momentum,
--outer-compression (which other strategies refuse: strategy.check_applies)."""

from __future__ import annotations

import math

from distrain.trainer.checks.need import need
from distrain.trainer.choices import OUTER_COMPRESSIONS, OUTER_OPTIMIZERS


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
