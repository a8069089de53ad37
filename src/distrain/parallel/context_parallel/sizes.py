"""Whether the all-to-all variant fits: cp against the heads it splits (pure; imports nothing but
errors and tensor parallelism's ``divisors``). The length rule (2 x cp divides the sequence) is
:func:`.load_balance.check_length`."""

from __future__ import annotations

from distrain.errors import ConfigError
from distrain.parallel.tensor_parallel.sizes import divisors

__all__ = ["check_cp_heads"]


def check_cp_heads(cp: int, heads: dict[str, int], what: str = "the model", tp: int = 1) -> None:
    """The all-to-all's rule: ``cp`` divides every head count of ``heads`` ({name: heads this rank
    holds before the split, i.e. per tp rank}); a one-line ConfigError naming each one that it does
    not divide and the cp values that divide them all. ``tp`` only words the message."""
    per = f" per tp rank (tp={tp})" if tp > 1 else ""
    bad = [f"{k}={n}{per}" for k, n in heads.items() if n % cp]
    if bad:
        fit = [d for d in divisors(min(heads.values())) if all(n % d == 0 for n in heads.values())]
        raise ConfigError(f"context parallelism (cp={cp}, all-to-all) does not fit {what}: the all-to-all gives every "
                          f"rank whole heads, but {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not divisible "
                          f"by cp={cp}; choose cp among {', '.join(map(str, fit))}, or the ring variant "
                          f"(--cp-algorithm ring), which splits no heads")
