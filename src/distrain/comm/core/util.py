"""Small helpers shared by every module of distrain.comm (written once, used everywhere).

* :data:`WIRE_DTYPES`: the dtypes with a stable one-byte code, in the order used by the
  ``send_tensor`` header and by the debug fingerprint (code = index; never reorder, append);
* :func:`nbytes`: payload bytes of a tensor (what the ledger and the cost model count);
* :func:`check_int`: the "is it a real int in range" check with a one-line error.
"""

from __future__ import annotations

import torch

from distrain.errors import ConfigError

WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
)
DTYPE_CODE: dict[torch.dtype, int] = {dt: i for i, dt in enumerate(WIRE_DTYPES)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(t: torch.Tensor) -> int:
    """Payload size of ``t`` in bytes (numel x element size; views count their own elements)."""
    return t.numel() * t.element_size()


def check_int(value, what: str, where: str, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` if it is an int (not a bool) with lo <= value < hi, else raise ConfigError.

    The message names the caller (``where``), the argument (``what``), the range and the value.
    """
    ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and lo is not None and value < lo:
        ok = False
    if ok and hi is not None and value >= hi:
        ok = False
    if not ok:
        rng = (f" in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'})"
               if lo is not None or hi is not None else "")
        raise ConfigError(f"{where}: {what} must be an int{rng}, got {value!r}")
    return value


# Collectives that star and tree compose through a fixed root (group rank 0) whatever the
# caller's root argument (all_reduce = reduce to 0 + broadcast from 0, ...).
COMPOSED_AT_ROOT = ("all_reduce", "all_gather", "reduce_scatter")


def chunk_sizes(N: int, P: int) -> list[int]:
    """Sizes of ``torch.tensor_split(t, P)`` for N elements: the first N mod P get one extra."""
    q, rem = divmod(N, P)
    return [q + 1 if i < rem else q for i in range(P)]


def chunk_bounds(N: int, P: int) -> list[tuple[int, int]]:
    """``(lo, hi)`` of each of the P parts of :func:`chunk_sizes`, in order."""
    out, lo = [], 0
    for k in chunk_sizes(N, P):
        out.append((lo, lo + k))
        lo += k
    return out
