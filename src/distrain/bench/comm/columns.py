"""The extra columns of ``distrain bench comm`` beside torch.distributed's transports.

* ``shm-python``: the shared-memory transport with its Python kernels (the readable reference
  of the compiled data plane, :mod:`distrain.comm.shm.compiled`), on a group of its own, so one
  run shows what the compiled plane buys: columns ``ALGORITHM@shm-python``.
* ``deepspeed``: DeepSpeed's CPU shared-memory all-reduce (its C++ op ``deepspeed_shm_comm``,
  called as ``torch.ops.deepspeed.inference_all_reduce_``: what ``deepspeed.comm.
  inference_all_reduce`` reaches), when ``deepspeed`` is importable. Optional, for comparison
  only; not a dependency. Its op sums float32/bfloat16/float16 only, whatever op or group is
  asked, so the column exists for all_reduce in those dtypes; one column, ``deepspeed``.

DeepSpeed names its shared-memory files after MASTER_ADDR and MASTER_PORT (fresh for every
spawn) and leaves them behind; :func:`deepspeed_close` removes this run's.
"""

from __future__ import annotations

import glob
import os

from distrain.errors import ConfigError

PYTHON_SHM = "shm-python"
DEEPSPEED = "deepspeed"
EXTRA = (PYTHON_SHM, DEEPSPEED)
DEEPSPEED_DTYPES = ("float32", "bfloat16", "float16")


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed column cannot run here, or None."""
    try:
        import deepspeed.ops.op_builder.cpu  # noqa: F401
    except Exception as e:  # ImportError, or its accelerator probe failing
        return f"deepspeed is not importable ({type(e).__name__}: {e}); pip install deepspeed, or drop it"
    return None


def check(transports: list[str], ops: list[str], dtype: str) -> None:
    """One-line errors before any rank starts."""
    if DEEPSPEED not in transports:
        return
    why = deepspeed_missing()
    if why:
        raise ConfigError(f"--transport {DEEPSPEED}: {why}")
    if ops != ["all_reduce"] or dtype not in DEEPSPEED_DTYPES:
        raise ConfigError(f"--transport {DEEPSPEED}: DeepSpeed's shared-memory op is an all_reduce (sum) of "
                          f"{', '.join(DEEPSPEED_DTYPES)} only; use --ops all_reduce and one of those --dtype")


def deepspeed_open(P: int, rank: int):
    """Build (JIT, cached by DeepSpeed) and initialise DeepSpeed's op in this rank; returns the call."""
    import torch
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    os.environ["LOCAL_SIZE"] = str(P)  # the op takes the shared-memory path only when every rank is local
    op = ShareMemCommBuilder().load(verbose=False)
    op.initialize(P, rank)
    return torch.ops.deepspeed.inference_all_reduce_


def deepspeed_close() -> None:
    """Remove this run's DeepSpeed files (named after the spawn's fresh MASTER_ADDR and MASTER_PORT)."""
    pattern = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
               f"{os.environ.get('MASTER_PORT', '')}_*")
    for path in glob.glob(pattern):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def transport_groups(transports: list[str], P: int) -> dict:
    """One group of all P ranks per transport (the world for the first), each transport set before
    its first message: {name: group}. ``shm-python`` is the shared-memory transport built with the
    Python kernels (they are fixed when a group's transport is built). DeepSpeed is not a group:
    left out here. Collective: every rank calls it with the same list."""
    import torch.distributed as dist

    from distrain import comm

    groups = {}
    for i, t in enumerate(t for t in transports if t != DEEPSPEED):
        g = None if i == 0 else dist.new_group(list(range(P)))
        if t == PYTHON_SHM:
            comm.set_shm_kernels("python")
            comm.set_transport("shm", g)
            comm.barrier(group=g)
            comm.set_shm_kernels("auto")
        else:
            comm.set_transport(t, g)
        groups[t] = g
    return groups
