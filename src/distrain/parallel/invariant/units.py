"""Units of work: the global batch as ``units`` equal pieces, the same in every layout.

A run with ``--layout-invariant`` cuts every global batch of B samples into U units of B / U samples; every
forward and backward runs on exactly one unit, so each kernel sees the same shapes whatever the number of
ranks (the batch-invariance argument of He & Thinking Machines Lab, "Defeating Nondeterminism in LLM
Inference", 2025: a kernel's result for a row may depend on the batch it runs in, never on the batch if the
batch is fixed). Replica d of D runs the contiguous units ``part_bounds(U, D, d)`` (so any D <= U works,
parts differing by one unit), one after the other.

Random numbers that a forward draws (dropout) come from a generator seeded by the run's seed, the step and
the unit's global index (``unit_seed``), never by the rank: a unit draws the same numbers wherever it runs,
and again when a step is run twice (an overflow's redo).
"""

from __future__ import annotations

import hashlib

MAX_DEFAULT_UNITS = 8


def default_units(batch_size: int) -> int:
    """The largest U <= 8 that divides the batch: what ``--units 0`` means."""
    return max(u for u in range(1, min(MAX_DEFAULT_UNITS, batch_size) + 1) if batch_size % u == 0)


def replica_units(units: int, replicas: int, replica: int) -> range:
    """The global unit indices replica ``replica`` of ``replicas`` runs: contiguous, the first
    ``units % replicas`` replicas one more (the data sampler's ``part_bounds`` over units)."""
    q, m = divmod(units, replicas)
    lo = replica * q + min(replica, m)
    return range(lo, lo + q + (replica < m))


def unit_seed(seed: int, step: int, unit: int) -> int:
    """A 63-bit generator seed for unit ``unit`` of step ``step`` of a run seeded ``seed``."""
    h = hashlib.blake2b(f"distrain-unit/{seed}/{step}/{unit}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


__all__ = ["MAX_DEFAULT_UNITS", "default_units", "replica_units", "unit_seed"]
