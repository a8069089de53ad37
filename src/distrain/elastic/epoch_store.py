"""The store an epoch's process group rendezvouses through: its waits end when the epoch does.

Why: ``init_process_group`` blocks in the store until every rank of the group has published its
address (Gloo's full mesh); a rank that died after the epoch's barrier never publishes, so its
peers waited the whole group time-out (``--collective-timeout``, 300 s by default) inside torch's
C++, while the coordinator, which had already ended the epoch, waited for them to arrive in the
next one: a second loss during a recovery stalled the job for minutes, and with a short time-out
the coordinator dropped every survivor and the job ended for lack of a rank.

An :class:`EpochStore` wraps the job's store (sealed, distrain.sealed) for one epoch. Every wait
Gloo makes through it (``wait``, and ``get`` of a key not yet written) polls the keys and the
epoch's end key (``lost/E``: the coordinator's word that the epoch lost a member; a change for a
newcomer waits for the group to open instead), and raises :class:`~distrain.errors.PeerLostError`
as soon as it exists: the rank leaves the half-opened group at once and arrives in the next epoch
with its peers. Reads of keys already there are one round trip, as before.

Hold the object for as long as the group lives (a Python store behind torch's C++ PrefixStore:
see distrain.sealed.SealedStore); :class:`~distrain.elastic.member.Member` keeps it.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from distrain.errors import CommError, PeerLostError

POLL_S = 0.005


class EpochStore(dist.Store):
    """``inner`` for the group of epoch ``epoch``; waits raise PeerLostError once ``end_key`` exists."""

    def __init__(self, inner: dist.Store, epoch: int, end_key: str, timeout: float):
        super().__init__()
        self.inner, self.epoch, self.end_key, self.limit = inner, epoch, end_key, timeout

    def _wait(self, keys: list[str], timeout: timedelta | None) -> None:
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) and timeout.total_seconds() > 0 \
            else self.limit
        deadline, delay = time.monotonic() + limit, POLL_S
        while not self.inner.check(keys):
            if self.inner.check([self.end_key]):
                raise PeerLostError(f"elastic: epoch {self.epoch} lost a member while its group was opening")
            if time.monotonic() > deadline:
                raise CommError(f"elastic: waited {limit:g}s for the group of epoch {self.epoch} to open")
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def get(self, key: str) -> bytes:
        if not self.inner.check([key]):
            self._wait([key], None)
        return self.inner.get(key)

    def set(self, key: str, value) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def compare_set(self, key: str, expected, desired) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        if not self.inner.check(keys):
            self._wait(keys, None)
        return self.inner.multi_get(keys)

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set(keys, values)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.limit = timeout.total_seconds()
