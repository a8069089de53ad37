"""Whether tensor parallelism fits: tp against the sizes it splits, one check for every plan (pure).

Every model's plan (the GPT's, the MLP's, the Llama's, Hugging Face decoders') and
:func:`~distrain.parallel.tensor_parallel.apply_tensor_parallel` itself check their sizes here,
before any module changes or any collective runs::

    check_tp_divides(4, {"n_head": 6, "n_embd": 256}, "the GPT")
    ConfigError: tensor parallelism (tp=4) does not fit the GPT: n_head=6 is not divisible by tp=4;
    choose tp among the divisors of 6: 1, 2, 3, 6. (tp values that divide every size: 1, 2)

(one line). ``rules`` ({name: why it is split}) adds the reason after a size's name; with more
than one size the message ends with the tp values that divide them all. Imports nothing but
distrain.errors.
"""

from __future__ import annotations

from typing import Mapping

from distrain.errors import ConfigError

__all__ = ["check_tp_divides", "divisors"]


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` (a positive int), ascending: the tp values that split ``n``."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _listed(ds: list[int]) -> str:
    return ", ".join(map(str, ds))


def check_tp_divides(tp: int, sizes: Mapping[str, int], what: str = "the model",
                     rules: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError naming every size of ``sizes`` ({name: n}) that ``tp`` does not divide,
    the divisors of each, ``rules[name]`` where given, and (for several sizes) the tp values that
    divide them all; ``what`` names the model or module. Also refuses a tp that is not a positive int."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tensor parallel: tp must be a positive int, got {tp!r}")
    rules = rules or {}
    bad = [f"{k}={n} is not divisible by tp={tp}" + (f" ({rules[k]})" if k in rules else "")
           + f"; choose tp among the divisors of {n}: {_listed(divisors(n))}" for k, n in sizes.items() if n % tp]
    if bad:
        msg = f"tensor parallelism (tp={tp}) does not fit {what}: " + ". ".join(bad)
        if len(sizes) > 1:
            fit = [d for d in divisors(min(sizes.values())) if all(n % d == 0 for n in sizes.values())]
            msg += f". (tp values that divide every size: {_listed(fit)})"
        raise ConfigError(msg)
