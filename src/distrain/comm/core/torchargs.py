"""torch.distributed's calling conventions, applied to every public comm function by one decorator.

Two rules torch.distributed has that are about the *call*, not the algorithm:

* **Non-members do nothing.** A rank that calls a collective or P2P operation on a group it
  does not belong to (``new_group`` hands non-members ``GroupMember.NON_GROUP_MEMBER``) gets
  a warning and an immediate return of ``None`` (``-1`` for ``recv``), so code written as
  "every rank calls, members take part" works unchanged. Nothing is sent and no sequence
  number is taken, so the members' tags stay in step.
* **Group-relative roots.** ``group_src=`` / ``group_dst=`` name the root (or peer) by its
  rank *inside* ``group`` instead of its global rank; exactly one of the two forms may be given.

Usage: ``@torch_call("src")`` above a function whose parameters include ``group`` and ``src``.
"""

from __future__ import annotations

import functools
import inspect
import warnings

import torch.distributed as dist

from distrain.comm.core.group import has_state
from distrain.errors import ConfigError


def not_member(group) -> bool:
    """True when this process is not in ``group`` (None = world, of which every rank is a member)."""
    if group is None or has_state(group) or not dist.is_initialized():
        return False  # a group whose state exists (group.py) has this rank as a member: no c10d call
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return True
    return dist.get_rank(group) < 0


def warn_not_member(name: str) -> None:
    warnings.warn(f"{name}: global rank {dist.get_rank()} is not a member of the group it was called on; "
                  f"the call does nothing on this rank (as in torch.distributed)", UserWarning, stacklevel=3)


def _group_relative(group, group_rank, what: str, name: str) -> int:
    g = dist.group.WORLD if group is None else group
    size = dist.get_world_size(g)
    if not isinstance(group_rank, int) or isinstance(group_rank, bool) or not 0 <= group_rank < size:
        raise ConfigError(f"{name}: group_{what}={group_rank!r} must be an int in [0, {size}) (a rank inside "
                          f"the group); pass {what}= for a global rank")
    return dist.get_global_rank(g, group_rank)


def torch_call(root: str | None = None, nonmember_result=None):
    """Decorate a public comm function: non-member no-op, and ``group_<root>=`` translation."""

    def deco(fn):
        params = list(inspect.signature(fn).parameters)
        g_at = params.index("group")
        r_at = params.index(root) if root else None
        rel = f"group_{root}" if root else None

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = args[g_at] if len(args) > g_at else kwargs.get("group")
            if rel is not None and rel in kwargs:
                grel = kwargs.pop(rel)
                if grel is not None:
                    given = args[r_at] if len(args) > r_at else kwargs.get(root)
                    if given is not None:
                        raise ConfigError(f"{fn.__name__}: give either {root}= (a global rank) or {rel}= "
                                          f"(a rank inside the group), not both")
                    if not_member(group):
                        warn_not_member(fn.__name__)
                        return nonmember_result
                    kwargs[root] = _group_relative(group, grel, root, fn.__name__)
            if not_member(group):
                warn_not_member(fn.__name__)
                return nonmember_result
            return fn(*args, **kwargs)

        wrapper.__signature__ = _with_relative(fn, rel)
        return wrapper

    return deco


def _with_relative(fn, rel: str | None) -> inspect.Signature:
    """fn's signature plus the keyword-only ``group_<root>`` parameter (for help() and introspection)."""
    sig = inspect.signature(fn)
    if rel is None or rel in sig.parameters:
        return sig
    ps = list(sig.parameters.values())
    extra = inspect.Parameter(rel, inspect.Parameter.KEYWORD_ONLY, default=None)
    at = next((i for i, p in enumerate(ps) if p.kind is inspect.Parameter.VAR_KEYWORD), len(ps))
    return sig.replace(parameters=ps[:at] + [extra] + ps[at:])
