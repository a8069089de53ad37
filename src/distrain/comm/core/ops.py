"""Reduction operators: parsing, dtype rules and the element-wise combine step.

Every algorithm (star, ring, tree) reduces with the same two primitives:

* ``combine(acc, x)``: acc <- acc (op) x, in place, element-wise;
* ``finish(t, n)``: applied once to the fully reduced result (only ``avg`` uses it: t <- t / n).

``avg`` is therefore computed as a sum followed by one division, which is also how we
offer it on Gloo, whose native backend has no AVG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from distrain.errors import ConfigError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
SUPPORTED_DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)


@dataclass(frozen=True)
class Op:
    """A resolved reduction: its name, how to combine two tensors, and the native ReduceOp."""

    name: str
    combine: Callable[[torch.Tensor, torch.Tensor], None]
    native: dist.ReduceOp.RedOpType  # the op passed to torch.distributed (avg -> SUM, then /n)
    needs_finish: bool = False

    def fold(self, out: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """out <- parts[0] (op) parts[1] (op) ..., left to right (out may be any of them or new)."""
        if len(parts) == 1:
            out.copy_(parts[0])
            return
        _BINARY[self.name](parts[0], parts[1], out=out)
        for x in parts[2:]:
            self.combine(out, x)

    def finish(self, t: torch.Tensor, n: int) -> None:
        if self.needs_finish:
            t.div_(n)


def _sum(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.add_(x)


def _prod(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.mul_(x)


def _min(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.minimum(acc, x, out=acc)


def _max(acc: torch.Tensor, x: torch.Tensor) -> None:
    torch.maximum(acc, x, out=acc)


def _band(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_and_(x)


def _bor(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_or_(x)


def _bxor(acc: torch.Tensor, x: torch.Tensor) -> None:
    acc.bitwise_xor_(x)


_BINARY = {"sum": torch.add, "avg": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum,
           "band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
_R = dist.ReduceOp
OPS: dict[str, Op] = {
    "sum": Op("sum", _sum, _R.SUM),
    "avg": Op("avg", _sum, _R.SUM, needs_finish=True),
    "prod": Op("prod", _prod, _R.PRODUCT),
    "min": Op("min", _min, _R.MIN),
    "max": Op("max", _max, _R.MAX),
    "band": Op("band", _band, _R.BAND),
    "bor": Op("bor", _bor, _R.BOR),
    "bxor": Op("bxor", _bxor, _R.BXOR),
}
_FROM_NATIVE = {
    _R.SUM: "sum", _R.AVG: "avg", _R.PRODUCT: "prod", _R.MIN: "min",
    _R.MAX: "max", _R.BAND: "band", _R.BOR: "bor", _R.BXOR: "bxor",
}
_ALIASES = {"product": "prod", "mean": "avg", "average": "avg"}
# Gloo reduces bool tensors as bytes saturated to 0/1: sum is OR, product is AND. Same here.
_BOOL_OPS = {"sum": Op("sum", _bor, _R.SUM), "prod": Op("prod", _band, _R.PRODUCT)}
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def op_name(op, collective: str) -> str:
    """The canonical name ("sum", "max", ...) of ``op``: a string, ReduceOp.X, or a ReduceOp object."""
    if isinstance(op, dist.ReduceOp) and not isinstance(op, dist.ReduceOp.RedOpType):  # a ReduceOp object, as opposed to ReduceOp.SUM (a RedOpType)
        op = op.op
    if isinstance(op, str):
        name = _ALIASES.get(op.lower(), op.lower())
    else:
        try:
            name = _FROM_NATIVE[op]
        except (KeyError, TypeError):
            name = None
    if name not in OPS:
        raise ConfigError(
            f"{collective}: unknown reduce op {op!r}; use one of {sorted(OPS)} or a torch.distributed.ReduceOp"
        )
    return name


def resolve_op(op, dtype: torch.dtype, collective: str) -> Op:
    """Turn ``op`` (a ReduceOp or a string) into an :class:`Op`, checking it makes sense for ``dtype``.

    Raises ConfigError (a ValueError) naming the collective, the op and the dtype.
    """
    name = op_name(op, collective)
    check_dtype(dtype, collective)
    if name == "avg" and not dtype.is_floating_point:
        raise ConfigError(
            f"{collective}: op 'avg' is not defined for integer dtype {dtype} (integer division would "
            f"truncate); use op='sum' and divide, or cast to a floating dtype"
        )
    if name in ("band", "bor", "bxor") and dtype.is_floating_point:
        raise ConfigError(
            f"{collective}: bitwise op {name!r} is not defined for floating dtype {dtype}; "
            f"use an integer or bool tensor"
        )
    if dtype == torch.bool and name in _BOOL_OPS:
        return _BOOL_OPS[name]
    return OPS[name]


def check_complex_op(op, dtype: torch.dtype, collective: str) -> None:
    """Complex tensors reduce as their real view, so only sum and avg are exact (torch's rule)."""
    if dtype in COMPLEX_DTYPES and op_name(op, collective) not in ("sum", "avg"):
        raise ConfigError(
            f"{collective} does not support op {op_name(op, collective)!r} on complex tensors (dtype {dtype}); "
            f"complex tensors support only 'sum' and 'avg' (as in torch.distributed)"
        )


def check_dtype(dtype: torch.dtype, collective: str) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise ConfigError(
            f"{collective}: dtype {dtype} is not supported; use one of "
            f"{', '.join(str(d).removeprefix('torch.') for d in SUPPORTED_DTYPES)}"
        )
