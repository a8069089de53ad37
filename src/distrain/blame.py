"""Which rank failed first: the one to blame when a job goes down.

When one rank dies, its peers fail too, a moment later, with "connection reset/closed by
peer" from the transport. Whoever reports first is therefore not necessarily the culprit.
The rules (applied by ``distrain.spawn`` to every failure seen within a short grace window):

1. a failure is *secondary* when it is the transport noticing a vanished peer: a PeerLostError
   (what the comm layer raises for every backend or transport failure under a call; see
   distrain.comm.core.failures), a CommError raised from a backend's RuntimeError, or a
   ConnectionError, anywhere in the exception chain. Decided by type, never by message text.
   Every other failure is *primary*: an exception in the rank's own code, or a process that ended
   without reporting (a signal, ``os._exit``), which is how a SIGKILLed rank looks;
2. the culprit is the primary failure with the earliest time (rank-side timestamp for
   reported errors, the parent's observation time for deaths); only if every failure is
   secondary is the earliest secondary one blamed;
3. a collective time-out reported by the watchdog (distrain.comm.core.watchdog) is blamed only
   if no rank failed outright: the ranks it names are hung, not dead.

A culprit ended by a signal is a :class:`RankKilledError` (its ``signal``), any other a RankFailedError.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrain.errors import (CollectiveTimeoutError, CommError, DistrainError, PeerLostError, RankFailedError,
                             RankKilledError)


@dataclass
class Failure:
    rank: int
    when: float  # time.time() of the failure (rank side) or of its observation (parent side)
    message: str  # the traceback, or how the process ended
    secondary: bool = False  # a reaction to another rank's failure
    died: bool = False  # ended without reporting
    hang: bool = False  # a collective time-out reported by the watchdog
    exitcode: int | None = None  # the process's exit code when it died (-N: killed by signal N)


def is_secondary(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception in its chain) is the transport seeing a peer vanish (by type)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (PeerLostError, ConnectionError)):
            return True
        cause = exc.__cause__
        if isinstance(exc, CommError) and isinstance(cause, (RuntimeError, OSError)) \
                and not isinstance(cause, DistrainError):
            return True  # a comm error raised from the backend's own failure
        exc = cause or exc.__context__
    return False


def blame(failures: dict[int, Failure]) -> DistrainError:
    """The error to raise for a set of failures (see the module docstring for the rules)."""
    fs = list(failures.values())
    primary = [f for f in fs if not f.secondary and not f.hang]
    if not primary and any(f.hang for f in fs):
        first = min((f for f in fs if f.hang), key=lambda f: (f.when, f.rank))
        return CollectiveTimeoutError(first.message)
    first = min(primary or fs, key=lambda f: (f.when, f.rank))
    if first.died and first.exitcode is not None and first.exitcode < 0:  # ended by a signal: RankKilledError
        err = RankKilledError(first.rank, first.message, signal=-first.exitcode)
    else:
        err = RankFailedError(first.rank, first.message, brief=not first.died and "\n" not in first.message)
    err.also_failed = sorted(r for r in failures if r != first.rank)
    return err
