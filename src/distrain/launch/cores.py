"""Which cores a local rank is bound to (MPI's ``--bind-to core``), chosen from the cores that are free.

A rank that polls shared memory wants a core of its own: two polling ranks on one core while
another core idles is the worst case (4 KiB shm all_reduce at P=2: 12-22 us bound, 88-101 us
not). But a bound rank cannot leave its core when other processes load it, and then binding
loses: P=2 shm all_reduce with 2 busy processes beside it, bound against unbound, two
alternations in one run each on the 2-core machine (GB/s busbw): 4 MiB 2.6-2.9 against
5.1-5.5, 64 MiB 0.93-1.30 against 1.24-1.51 (only 4 KiB gained from binding, 0.10-0.14
against 0.01-0.04). So the automatic choice binds only when there are P free cores, measured
over a short interval from /proc/stat, and binds to the freest ones.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

FREE_IDLE = 0.5  # a core is free when it was idle at least this fraction of the sample
SAMPLE_S = 0.05  # how long the idle times are sampled


def core_slices(nprocs: int, cores: Sequence[int] | None = None) -> list[list[int]] | None:
    """Disjoint cores for each of ``nprocs`` local ranks, or None when there are fewer cores than
    ranks. ``cores``: the CPUs to use (default: this process's affinity), taken in increasing
    order. Rank r gets ``cores[r*k:(r+1)*k]`` with k = len(cores) // nprocs."""
    cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
    k = len(cores) // nprocs
    if k < 1:
        return None
    return [cores[r * k:(r + 1) * k] for r in range(nprocs)]


def _idle_times() -> dict[int, tuple[int, int]]:
    """Per CPU: (idle + iowait jiffies, total jiffies) since boot, from /proc/stat."""
    out = {}
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                v = [int(x) for x in vals]
                out[int(name[3:])] = (v[3] + (v[4] if len(v) > 4 else 0), sum(v[:8]))
    return out


def idle_fractions(sample_s: float = SAMPLE_S) -> dict[int, float]:
    """Each usable core's idle fraction over ``sample_s`` seconds ({} where /proc/stat is missing)."""
    try:
        a = _idle_times()
        time.sleep(sample_s)
        b = _idle_times()
    except (OSError, ValueError, IndexError):
        return {}
    usable = os.sched_getaffinity(0)
    return {c: (b[c][0] - a[c][0]) / max(1, b[c][1] - a[c][1]) for c in b if c in a and c in usable}


def free_core_slices(nprocs: int, idle: dict[int, float] | None = None) -> list[list[int]] | None:
    """Cores for each rank from the free ones (idle >= FREE_IDLE), freest first; None when fewer
    than ``nprocs`` cores are free (then the ranks are left to the scheduler)."""
    idle = idle_fractions() if idle is None else idle
    free = sorted((c for c, f in idle.items() if f >= FREE_IDLE), key=lambda c: (-idle[c], c))
    if len(free) < nprocs:
        return None
    return core_slices(nprocs, sorted(free[:len(free) // nprocs * nprocs]))
