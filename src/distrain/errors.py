"""Exceptions raised by distrain.

Every error says what is wrong and how to fix it: which rank, which collective,
which argument. They all derive from DistrainError so callers can catch one type.
"""

from __future__ import annotations


class DistrainError(RuntimeError):
    """Base class of every error distrain raises on purpose."""


class ConfigError(DistrainError, ValueError):
    """A configuration or argument is invalid (raised before any process-group work)."""


class CommError(DistrainError):
    """A collective or point-to-point operation failed on this rank."""


class PeerLostError(CommError):
    """The group broke under a communication call: a peer is gone (died, closed its connections),
    silent past the time-out, or the group was aborted. The comm layer raises it for every failure
    of the backend or transport under an operation (Gloo and NCCL raise RuntimeError; a shared-memory
    peer dies or aborts); elastic training catches this type to re-form the group, and blame counts it
    as the echo of another rank's failure. Decided by where the error came from, never by its text."""


class RankFailedError(DistrainError):
    """A spawned rank raised or died; carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, brief: bool = False):
        # brief: a one-line distrain error from the rank, shown on the same line
        super().__init__(f"rank {rank} failed:{' ' if brief else chr(10)}{message}")
        self.rank = rank
        self.remote_message = message


class RankKilledError(RankFailedError):
    """A rank ended by a signal without a word (SIGKILL from the OOM killer, SIGTERM from an operator, ...);
    ``signal`` is the signal's number."""

    def __init__(self, rank: int, message: str, brief: bool = False, signal: int = 0):
        super().__init__(rank, message, brief)
        self.signal = signal


class SpawnTimeoutError(DistrainError, TimeoutError):
    """spawn() ran past its timeout; the message names the ranks still running."""


class TrainingError(DistrainError):
    """Training cannot go on (e.g. a NaN loss); the message says what to change."""


class ReplicaMismatchError(TrainingError):
    """Ranks that should hold the same parameters and optimizer state bit for bit (data-parallel replicas)
    do not: silent data corruption (``--check-replicas``, trainer/replicas.py). The one-line message names
    the step, the ranks whose bits differ and the last checkpoint that is kept."""


class CollectiveTimeoutError(CommError, TimeoutError):
    """A collective did not complete within the collective time-out, or (a fixed job) a rank it waits
    on stopped sending heartbeats; the message names the ranks that did not arrive and the call they
    were expected at (comm/core/watchdog.py)."""


class DataPlaneMismatchError(ConfigError):
    """The compiled shared-memory data plane (the C++ extension) was built from other source than the
    Python beside it: a code or layout constant it exports differs from the Python reference's (checked
    at import, distrain.comm.shm.compiled.check_extension). The message names both values; rebuild it."""


class ClusterError(DistrainError):
    """The emulated cluster could not be built, found or used."""
