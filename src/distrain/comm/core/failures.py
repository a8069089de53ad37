"""What a failure under a communication call means: the one place that decides it, by type.

Every call into a backend (Gloo, NCCL) or a transport ends in one of three ways: it completes, our
own checks refuse it before anything is sent (ConfigError, CommError naming the argument), or the
transport fails under it. Torch's backends report the last kind as RuntimeError (DistError and its
subclasses are RuntimeErrors) and sockets as OSError; :func:`lost` turns such an exception into
:class:`~distrain.errors.PeerLostError` (a peer gone, silent or the group aborted), any other into
a plain CommError. The decision is by the exception's type and the place it was raised (inside
the backend call), never by its message.

:func:`transport_errors` applies the same rule to code that must call torch.distributed itself
(opening a group, the object collectives of a checkpoint): ``with transport_errors("what"): ...``.
"""

from __future__ import annotations

from contextlib import contextmanager

from distrain.errors import CommError, PeerLostError

__all__ = ["lost", "transport_errors"]


def lost(desc: str, exc: BaseException) -> CommError:
    """The error to raise for ``exc``, raised under the communication call ``desc``."""
    if isinstance(exc, CommError):
        return exc
    kind = PeerLostError if isinstance(exc, (RuntimeError, OSError)) else CommError
    return kind(f"{desc} failed: {exc}")


@contextmanager
def transport_errors(desc: str):
    """Re-raise a backend or transport failure inside the block as PeerLostError (see :func:`lost`)."""
    try:
        yield
    except CommError:
        raise
    except (RuntimeError, OSError) as e:
        raise lost(desc, e) from e
