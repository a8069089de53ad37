"""Traffic ledger: count what this rank sends and receives, per (operation, algorithm).

Usage::

    with distrain.comm.core.ledger() as led:
        comm.all_reduce(t, algorithm="ring")
    led.bytes_sent("all_reduce", "ring")   # exact payload bytes this rank sent

Counting happens in the P2P layer (``PeerComm``), so every byte our algorithms move is
seen, and only payload is counted (no TCP/Gloo framing). Native calls cannot be seen
inside Gloo/NCCL: they are recorded as calls with their payload size (``payload_bytes``)
and zero sent/received bytes. Each rank has its own ledger; ledgers nest (all active ones
record). Recording is thread-safe because asynchronous collectives run on worker threads.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import asdict, dataclass

_lock = threading.Lock()
_active: list["Ledger"] = []


@dataclass
class Counts:
    calls: int = 0
    bytes_sent: int = 0
    bytes_recv: int = 0
    msgs_sent: int = 0
    msgs_recv: int = 0
    payload_bytes: int = 0  # size of the user's tensor(s) per call, summed over calls

    def add(self, other: "Counts") -> None:
        for k, v in asdict(other).items():
            setattr(self, k, getattr(self, k) + v)


class Ledger:
    """Per-rank traffic counts keyed by (op, algorithm). Use as a context manager."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, str], Counts] = defaultdict(Counts)

    # -- context manager -------------------------------------------------------------
    def __enter__(self) -> "Ledger":
        with _lock:
            _active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _lock:
            _active.remove(self)

    # -- queries ---------------------------------------------------------------------
    def get(self, op: str, algorithm: str) -> Counts:
        return self.entries.get((op, algorithm), Counts())

    def bytes_sent(self, op: str | None = None, algorithm: str | None = None) -> int:
        return self.total(op, algorithm).bytes_sent

    def bytes_recv(self, op: str | None = None, algorithm: str | None = None) -> int:
        return self.total(op, algorithm).bytes_recv

    def total(self, op: str | None = None, algorithm: str | None = None) -> Counts:
        """Sum over entries matching ``op`` and ``algorithm`` (None matches all)."""
        out = Counts()
        for (o, a), c in list(self.entries.items()):
            if (op is None or o == op) and (algorithm is None or a == algorithm):
                out.add(c)
        return out

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {f"{o}/{a}": asdict(c) for (o, a), c in sorted(self.entries.items())}

    def reset(self) -> None:
        self.entries.clear()

    def __repr__(self) -> str:
        return f"Ledger({self.as_dict()})"


def ledger() -> Ledger:
    """A new ledger; enter it with ``with`` to start recording."""
    return Ledger()


def recording() -> bool:
    """Whether any ledger is active (a caller on a hot path skips building its counts when none is)."""
    return bool(_active)


def record(op: str, algorithm: str, *, calls: int = 0, sent: int = 0, recv: int = 0,
           msgs_sent: int = 0, msgs_recv: int = 0, payload: int = 0) -> None:
    """Add counts to every active ledger (no-op when none is active: the hot path stays cheap)."""
    if not _active:
        return
    with _lock:
        for led in _active:
            c = led.entries[(op, algorithm)]
            c.calls += calls
            c.bytes_sent += sent
            c.bytes_recv += recv
            c.msgs_sent += msgs_sent
            c.msgs_recv += msgs_recv
            c.payload_bytes += payload
