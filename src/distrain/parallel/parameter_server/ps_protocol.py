"""What the parameter server (ps.py) and its workers (ps_worker.py) share: the message tags
(the protocol's table is in ps.py's docstring), the set-up check both roles run on their
arguments (``check_setup``) and the wrapper that turns a transport failure into a CommError naming
both roles (``over_transport``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from distrain.comm.core import tags
from distrain.errors import CommError, ConfigError
from distrain.parallel.parameter_server.ps_layout import PSLayout

MODES = ("sync", "async")
# one tag per message kind, in the parameter server's range of distrain.comm.core.tags
TAG_HELLO, TAG_REQ, TAG_VERSION, TAG_PULL, TAG_PUSH_HDR, TAG_PUSH = (tags.PARAMETER_SERVER.at(i) for i in range(6))
MAGIC = 0x5053  # "PS"
I64 = torch.int64
# the hello's mode word: MODES.index(mode), plus this bit when the pushes are fixed-point integers
# (--layout-invariant: int64 sums at shared exponents, ps.py's table); the default hello keeps its bytes
FIXED_POINT = 1 << 8


def mode_word(mode: str, fixed_point: bool) -> int:
    """The hello's mode word: which mode, and whether the pushes are fixed-point integers."""
    return MODES.index(mode) | (FIXED_POINT if fixed_point else 0)


def describe_mode_word(word: int) -> str:
    """A hello's mode word in words (for a disagreement's message)."""
    k = word & ~FIXED_POINT
    mode = repr(MODES[k]) if 0 <= k < len(MODES) else str(k)
    return mode + (" with fixed-point pushes" if word & FIXED_POINT else "")


def check_setup(who: str, model: nn.Module, layout: PSLayout, mode: str, want_server: bool) -> tuple[int, list]:
    """This rank and the model's parameters, after checking the arguments against the job."""
    if not isinstance(layout, PSLayout):
        raise ConfigError(f"{who}: layout must be a PSLayout, got {type(layout).__name__}")
    if mode not in MODES:
        raise ConfigError(f"{who}: mode must be 'sync' or 'async', got {mode!r}")
    if not dist.is_initialized():
        raise ConfigError(f"{who}: no process group; call distrain.runtime.init() or use distrain.spawn")
    if dist.get_backend() != "gloo":
        raise ConfigError(f"{who}: the parameter server runs on Gloo (CPU tensors); this job uses {dist.get_backend()}")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != layout.world_size:
        raise ConfigError(f"{who}: the layout is for {layout.world_size} ranks but the job has {world}")
    if layout.is_server(rank) != want_server:
        raise ConfigError(f"{who}: rank {rank} is a {layout.role(rank)} in this layout (servers are ranks "
                          f"{layout.servers}); build a {'ParameterServer' if want_server else 'PSWorker'} there")
    return rank, layout.check_model(model, who)


class ProtocolError(CommError):
    """The peer sent something the protocol does not allow (not a transport failure)."""


def over_transport(me: str, peer: str, what: str, fn):
    """Run a transport action; any failure becomes a CommError naming both roles."""
    try:
        return fn()
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001  (Gloo raises RuntimeError; comm wraps it in CommError)
        raise CommError(f"{me}: {peer} disconnected during {what}: {e}") from e


def step_name(step: int, num_steps: int) -> str:
    """How messages name a step: "step k", or "the final pull" past the last one."""
    return "the final pull" if step >= num_steps else f"step {step}"
