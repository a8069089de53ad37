"""The B / W split of a backward pass: input gradients now, weight gradients later.

Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024; :mod:`.zero_bubble`)
run the backward of a micro-batch as two ops: B computes only what the previous stage waits
for, the gradient of the stage's input; W computes the weight gradients, later, to fill the
bubble. For a linear layer y = x A^T + b (x (N, C), A (O, C), y (N, O), N = all leading dims)
the backward is three independent products::

    dx = dy A            (N, O) @ (O, C)   -- needed by the layer below: B
    dA = dy^T x          (O, N) @ (N, C)   -- needed by the optimizer only: W
    db = sum_N dy        (O,)              -- W

Contract (Megatron-LM's "weight-gradient store", here by interception, not by new layers):

* Inside ``with defer_weight_grads(store, key):`` every ``F.linear(x, weight, bias)`` whose
  ``weight`` (and bias, if it requires grad) is a leaf parameter runs as :class:`_SplitLinear` -- ``nn.Linear`` and the tensor-parallel
  Column/RowParallelLinear all call ``F.linear``, so the model's code is untouched. Its
  backward returns dx and pushes a closure computing dA (and db) onto ``store`` under ``key``
  (the micro-batch); autograd gives the weight and bias no gradient then.
* ``store.flush(key)`` runs those closures in the order they were pushed and accumulates
  into ``.grad`` (``grad = g`` when None, else ``grad += g``): the W op.
* Every other parameter (LayerNorm, embeddings, a bias added outside ``F.linear``, a weight
  computed from parameters, e.g. by weight norm) gets its gradient from autograd during B, as
  usual. Together the same sums as one backward.
* Run the backward (B) inside the same block too: activation checkpointing then recomputes
  the same split ops (its recomputation must save what the forward saved).
* A custom autograd Function can defer its own weight-gradient work: :func:`deferral` returns
  the active ``(store, key)`` during the forward (or None), to save in ``ctx`` and use in backward.
* Not under autocast (``torch.is_autocast_enabled``): the split would have to redo its casts;
  refused with ConfigError.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from distrain.errors import ConfigError

__all__ = ["WeightGradStore", "check_no_autocast", "defer_weight_grads", "deferral"]

_ACTIVE: contextvars.ContextVar[tuple["WeightGradStore", int] | None] = contextvars.ContextVar(
    "distrain_weight_grad_deferral", default=None)


class WeightGradStore:
    """Deferred weight-gradient closures per key (micro-batch), and the bytes they keep alive."""

    def __init__(self):
        self._queues: dict[int, list[Callable[[], None]]] = {}
        self._bytes: dict[int, int] = {}
        self._seen: dict[int, set[int]] = {}  # data_ptrs counted per key (q/k/v share one input x)

    def defer(self, key: int, fn: Callable[[], None], *held: torch.Tensor) -> None:
        """Queue ``fn`` under ``key``; ``held``: the tensors it keeps alive (counted once each)."""
        self._queues.setdefault(key, []).append(fn)
        seen = self._seen.setdefault(key, set())
        for t in held:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                self._bytes[key] = self._bytes.get(key, 0) + t.numel() * t.element_size()

    def flush(self, key: int) -> int:
        """Run and drop the closures of ``key`` (oldest first); returns how many ran."""
        fns = self._queues.pop(key, [])
        self._bytes.pop(key, None)
        self._seen.pop(key, None)
        with torch.no_grad():
            for fn in fns:
                fn()
        return len(fns)

    def pending(self) -> list[int]:
        """Keys with closures still queued."""
        return sorted(self._queues)

    def held_bytes(self) -> int:
        """Bytes of inputs and output gradients kept for the queued W passes."""
        return sum(self._bytes.values())

    def clear(self) -> None:
        self._queues.clear()
        self._bytes.clear()
        self._seen.clear()


def _accumulate(p: torch.Tensor, g: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = g.detach()
    else:
        p.grad.add_(g)


def _linear_weight_grad(weight, bias, x, dy) -> None:
    dy2 = dy.reshape(-1, dy.shape[-1])            # (N, O)
    x2 = x.reshape(-1, x.shape[-1])               # (N, C)
    if weight is not None:
        _accumulate(weight, dy2.t().mm(x2))       # dA = dy^T x: (O, C)
    if bias is not None:
        _accumulate(bias, dy2.sum(0))             # db: (O,)


class _SplitLinear(torch.autograd.Function):
    """y = F.linear(x, weight, bias); backward returns dx and defers dA, db to the store.

    Only x goes through ``save_for_backward`` (so saved-tensor hooks, e.g. sequence parallelism's
    re-gather, see it); weight and bias are kept as the parameter objects themselves: a tensor
    unpacked from a hook may be another object, and W must accumulate into the parameter's ``.grad``."""

    @staticmethod
    def forward(ctx, x, weight, bias, store, key):
        ctx.save_for_backward(x)
        ctx.store, ctx.key, ctx.weight, ctx.bias = store, key, weight, bias
        return F.linear(x, weight, bias)          # (..., C) -> (..., O)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        dx = dy.matmul(ctx.weight) if ctx.needs_input_grad[0] else None   # (..., O) @ (O, C) -> (..., C): B
        w = ctx.weight if ctx.needs_input_grad[1] else None
        b = ctx.bias if ctx.needs_input_grad[2] else None
        if w is not None or b is not None:
            ctx.store.defer(ctx.key, lambda: _linear_weight_grad(w, b, x, dy), x, dy)
        return dx, None, None, None, None


def _leaf_param(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf


class _InterceptLinear(TorchFunctionMode):
    def __init__(self, store: WeightGradStore, key: int):
        super().__init__()
        self.store, self.key = store, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight, bias = list(args) + [None] * (3 - len(args))
            x, weight, bias = kwargs.get("input", x), kwargs.get("weight", weight), kwargs.get("bias", bias)
            # only parameters (leaves): a weight computed from others (weight norm, a parametrization)
            # must pass its gradient on through autograd, which a deferred .grad would not
            if _leaf_param(weight) and (bias is None or _leaf_param(bias) or not bias.requires_grad):
                return _SplitLinear.apply(x, weight, bias, self.store, self.key)
        return func(*args, **kwargs)


def check_no_autocast() -> None:
    """ConfigError under autocast: the split would bypass its casts (see the module doc)."""
    if any(torch.is_autocast_enabled(device) for device in ("cpu", "cuda")):
        raise ConfigError("the zero-bubble B/W split does not run under autocast (the deferred weight "
                          "gradients would skip its casts); use --schedule 1f1b with --autocast, or no autocast")


@contextlib.contextmanager
def defer_weight_grads(store: WeightGradStore, key: int):
    """Run a forward whose backward leaves the linear layers' weight gradients in ``store`` under ``key``."""
    check_no_autocast()
    token = _ACTIVE.set((store, key))
    try:
        with _InterceptLinear(store, key):
            yield store
    finally:
        _ACTIVE.reset(token)


def deferral() -> tuple[WeightGradStore, int] | None:
    """The ``(store, key)`` of the innermost :func:`defer_weight_grads` block, or None outside one."""
    return _ACTIVE.get()
