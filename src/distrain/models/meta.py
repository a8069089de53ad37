"""Building a model for its shapes alone: on the meta device, with no initialiser run.

Every check that needs a model's shapes before any rank starts (its parameter count for the memory
check, its state-dict shapes for ``--init-from`` and ``--resume``, the cost model's sizes) builds it
under :func:`shapes_only`. The meta device alone allocates nothing, but a random fill on a meta tensor
(``nn.init.normal_``, ``Tensor.uniform_``: every ``reset_parameters``) runs PyTorch's Python reference
of the op, whose first call imports ``torch._dynamo``: measured on the 2-core host, 1.5-3 s of CPU in the
``distrain train`` process to count gpt-tiny's 67,776 parameters, against 2 ms for the build itself.
Under :func:`shapes_only` those fills return their tensor untouched (a meta tensor has no values to
fill), so the build is shapes only, as it says.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# the in-place fills a module's initialisation calls: torch.nn.init's and the Tensor methods they wrap
_INIT = (torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.trunc_normal_, torch.nn.init.constant_,
         torch.nn.init.ones_, torch.nn.init.zeros_, torch.nn.init.eye_, torch.nn.init.dirac_,
         torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_uniform_,
         torch.nn.init.kaiming_normal_, torch.nn.init.orthogonal_, torch.nn.init.sparse_)
_FILLS = (torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
          torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_, torch.Tensor.random_,
          torch.Tensor.fill_, torch.Tensor.zero_)


class _NoFill(TorchFunctionMode):
    """Returns the tensor of an initialiser or a fill on a meta tensor unchanged; every other call runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INIT or func in _FILLS:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


@contextmanager
def shapes_only():
    """Modules built inside are on the meta device and skip their random initialisation (see the module)."""
    with torch.device("meta"), _NoFill():
        yield
