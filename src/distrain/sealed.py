"""The job's secret, and the store sealed with it: only the job's own processes read or write its keys.

Why: torch's TCPStore has no authentication. Anyone who can open a TCP connection to its port (another
user of the host through the loopback, anything on the network for a multi-node store) can list its
keys (``list_keys``), read every value and write any key. torch's answer is "trusted networks only";
distrain's jobs run on shared hosts, so every job has a secret and every store it talks through is a
:class:`SealedStore` over the plain one:

* **key names** are ``HMAC-SHA256(k_name, key)`` (32 hex characters): a stranger who lists the keys sees
  opaque names, and cannot make the name of a key the job will read;
* **values** are sealed with AES-256-GCM (an authenticated cipher: confidentiality and integrity in one,
  from the ``cryptography`` package) under a key derived from the secret, a random 96-bit nonce per
  value and the sealed key name as associated data (a value moved under another key does not open).
  A value that does not open raises :class:`StoreTamperedError` (a CommError), never garbage, and no
  value is ever unpickled;
* **counters** (``add``): the store increments them on the server, so they cannot be sealed. Their names
  are hidden like every key's; a stranger who finds one can bump it. distrain uses counters only as hints
  (a heartbeat, "news to read"): the data they point at is sealed, and a bumped counter can delay a
  decision, never change one.

A stranger can still delete keys, bump counters or flood the server: they can stop a job, not steer it
(docs/security.md says what is trusted and what is not).

The secret is 32 random bytes, hex in ``DISTRAIN_JOB_SECRET`` (:data:`ENV`). The launchers make one per
job and hand it to their ranks in the environment (``/proc/PID/environ`` is readable by the same user
only; a command line is readable by all, so it never goes there); a job over several machines takes the
same value on every node from the user (``distrain secret`` prints a new one), or from ``distrain cluster
run``. Only the process edges read the variable (launch, runtime, the elastic rank's setup, cli).

Derived keys (HMAC-SHA256 of the secret with a label, the one-block HKDF-Expand of RFC 5869):
``names`` (key names), ``values`` (the AES key), and :func:`tag` for other authenticated data (torchrun's
rendezvous state, rendezvous.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from datetime import timedelta

import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from distrain.errors import CommError, ConfigError

ENV = "DISTRAIN_JOB_SECRET"
MIN_CHARS = 32  # a user-given secret: at least 32 characters (`distrain secret` prints 64 hex)
_VERSION = b"\x01"
_NONCE = 12


class StoreTamperedError(CommError):
    """A value in the job's store does not open with the job's secret: written by someone without it
    (another user, another job on the same port), or damaged."""


def new() -> str:
    """A fresh secret: 32 random bytes as 64 hex characters."""
    return secrets.token_hex(32)


def check(text: str, where: str = ENV) -> bytes:
    """The secret's bytes, or a one-line ConfigError when ``text`` is too short to be one."""
    text = (text or "").strip()
    if len(text) < MIN_CHARS:
        raise ConfigError(f"{where} holds {len(text)} character(s); a job secret needs at least {MIN_CHARS} (make one "
                          f"with `distrain secret` and give every node the same value)")
    return text.encode()


def derive(secret: bytes, label: str) -> bytes:
    """32 bytes for one use of the secret (HMAC-SHA256 with ``label``: HKDF-Expand's first block)."""
    return hmac.new(secret, b"distrain/" + label.encode() + b"\x01", hashlib.sha256).digest()


def tag(secret: bytes, data: bytes, label: str = "tag") -> bytes:
    """An authentication tag of ``data`` (HMAC-SHA256 under a key derived for ``label``), 32 bytes."""
    return hmac.new(derive(secret, label), data, hashlib.sha256).digest()


def _as_bytes(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class SealedStore(dist.Store):
    """A torch.distributed store whose keys are hidden and whose values are sealed with the job's secret
    (see the module docstring). It wraps any store (``inner``: a TCPStore) and can be handed to
    ``init_process_group``, a ``PrefixStore`` or anything else that takes a store; Gloo's own rendezvous
    goes through it too. ``port`` and ``host`` are the inner store's.

    Hold a reference to it for as long as C++ uses it (a process group, a PrefixStore over it): C++ keeps
    only the C++ half of a store written in Python alive, and a call after the Python object was collected
    fails with torch's "Not implemented" (runtime.init keeps the group's until shutdown)."""

    def __init__(self, inner: dist.Store, secret: bytes):
        super().__init__()
        self.inner = inner
        self._names = derive(secret, "names")
        self._aead = AESGCM(derive(secret, "values"))

    # -- the inner store's address (the elastic layer keeps its connection open when it severs Gloo's) --
    @property
    def port(self) -> int:
        return self.inner.port

    @property
    def host(self) -> str:
        return self.inner.host

    # -- sealing --------------------------------------------------------------------------------------
    def name(self, key: str) -> str:
        """The inner store's name of ``key``."""
        return "k/" + hmac.new(self._names, key.encode(), hashlib.sha256).hexdigest()[:32]

    def seal(self, key: str, value) -> bytes:
        nonce = os.urandom(_NONCE)
        return _VERSION + nonce + self._aead.encrypt(nonce, _as_bytes(value), self.name(key).encode())

    def open(self, key: str, sealed: bytes) -> bytes:
        """The plain value of ``key`` from its sealed bytes; StoreTamperedError when they do not open."""
        sealed = bytes(sealed)
        if len(sealed) < 1 + _NONCE + 16 or sealed[:1] != _VERSION:
            raise StoreTamperedError(f"store key {key!r}: its value is not sealed with this job's secret (written by "
                                     f"a process outside the job; {self._where()})")
        try:
            return self._aead.decrypt(sealed[1:1 + _NONCE], sealed[1 + _NONCE:], self.name(key).encode())
        except InvalidTag:
            raise StoreTamperedError(f"store key {key!r}: its value does not open with this job's secret (written by "
                                     f"a process outside the job; {self._where()})") from None

    def _where(self) -> str:
        try:
            return f"store {self.inner.host}:{self.inner.port}"
        except (AttributeError, RuntimeError):
            return "the job's store"

    # -- the Store interface ----------------------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self.inner.set(self.name(key), self.seal(key, value))

    def get(self, key: str) -> bytes:
        return self.open(key, self.inner.get(self.name(key)))

    def multi_set(self, keys: list[str], values: list) -> None:
        self.inner.multi_set([self.name(k) for k in keys], [self.seal(k, v) for k, v in zip(keys, values)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.open(k, v) for k, v in zip(keys, self.inner.multi_get([self.name(k) for k in keys]))]

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(self.name(key), amount)  # a counter: hidden, not sealed (module docstring)

    def compare_set(self, key: str, expected, desired) -> bytes:
        """Set ``key`` to ``desired`` if its value is ``expected`` (b"" / "": if it is absent); returns the value
        it holds afterwards. Atomic on the inner store: the swap is made against the sealed bytes read."""
        expected, name = _as_bytes(expected), self.name(key)
        current = self.inner.get(name) if self.inner.check([name]) else None
        if (current is None and expected) or (current is not None and self.open(key, current) != expected):
            return self.open(key, current) if current is not None else expected
        got = self.inner.compare_set(name, current if current is not None else b"", self.seal(key, desired))
        return self.open(key, got)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check([self.name(k) for k in keys])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        names = [self.name(k) for k in keys]
        if timeout is None:
            self.inner.wait(names)
        else:
            self.inner.wait(names, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(self.name(key))

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.inner.set_timeout(timeout)


def seal(store: dist.Store, secret: bytes | None) -> dist.Store:
    """``store`` sealed with ``secret``, or ``store`` itself when there is none (a job started by a
    launcher that is not distrain's: torch's own trust model, trusted networks only)."""
    return store if secret is None else SealedStore(store, secret)


__all__ = ["ENV", "SealedStore", "StoreTamperedError", "check", "derive", "new", "seal", "tag"]
