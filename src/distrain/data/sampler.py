"""Data-parallel batch sampler on plain ints (no torch.distributed here).

Rule
----
* Epoch ``e`` uses a seeded bijection of the ``n`` dataset indices, :class:`FeistelPermutation`
  keyed by ``(seed, e)`` (``shuffle=False``: the identity, every epoch): position ``p`` of the
  epoch's order is the index ``perm(p)``, computed for the positions a step needs and nothing
  more, so the sampler's memory does not grow with the data set (a stored permutation of a
  2.6 GB token set's windows took 150 MiB per rank; docs/data.md).
* The permutation is cut into consecutive global batches of ``global_batch_size``;
  the last incomplete global batch of every epoch is dropped (drop_last), so
  ``steps_per_epoch = n // global_batch_size``.
* Global step ``s`` is step ``s % steps_per_epoch`` of epoch ``s // steps_per_epoch``.
  Its global batch is ``perm(k*G .. (k+1)*G - 1)`` and dp rank ``r`` of ``dp_size`` takes the
  contiguous slice ``[r*L : (r+1)*L]`` of it, with ``L = G // dp_size`` the local batch.
* ``global_batch_size`` must be divisible by ``dp_size`` (ConfigError otherwise).
* ``part(step, dp_rank, dp_size)`` cuts the same global batch for any ``dp_size`` (an elastic job's
  live replicas): contiguous parts whose sizes differ by at most one, the first
  ``G % dp_size`` parts one larger (:func:`part_bounds`); for a ``dp_size`` that divides ``G``
  these are exactly the slices above.

Consequences: the global batch of a step does not depend on dp_size, so runs at
different world sizes see the same data step by step; concatenating the rank
slices in rank order gives back the global batch; slices of one step are disjoint.
Resuming: ``batches(start_step)``, ``batch(step)``, or ``state_dict`` /
``load_state_dict`` (the state is just the next global step).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from distrain.errors import ConfigError


class FeistelPermutation:
    """A seeded bijection of ``[0, n)``, evaluated position by position (O(k) time and memory for k positions).

    A balanced Feistel network of ``ROUNDS`` rounds on the smallest domain of ``2 * half`` bits that holds
    ``n`` (round function: the splitmix64 finalizer of the right half xor the round's key, cut to ``half``
    bits; keys drawn by ``numpy.random.default_rng([seed, epoch])``) is a permutation of that domain
    (Luby and Rackoff 1988); *cycle-walking* (apply it again while the value is ``>= n``) restricts it to a
    permutation of ``[0, n)`` (Black and Rogaway, "Ciphers with arbitrary finite domains", 2002). The
    domain is less than 4n, so a position walks fewer than 4 times on average."""

    ROUNDS = 6
    _M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)

    def __init__(self, n: int, seed: int, epoch: int):
        self.n = n
        self.half = max(1, ((max(n, 2) - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = np.random.default_rng([seed, epoch]).integers(0, 2 ** 63, self.ROUNDS, dtype=np.uint64)

    def _round(self, x: np.ndarray, key: np.uint64) -> np.ndarray:
        z = x ^ key
        z = (z ^ (z >> np.uint64(30))) * self._M1
        z = (z ^ (z >> np.uint64(27))) * self._M2
        return (z ^ (z >> np.uint64(31))) & self.mask

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << h) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The indices at ``positions`` (ints in ``[0, n)``) of the permuted order, as int64."""
        with np.errstate(over="ignore"):  # (the multiplications wrap modulo 2**64 on purpose)
            out = self._feistel(np.asarray(positions, dtype=np.uint64))
            walk = out >= self.n
            while walk.any():
                out[walk] = self._feistel(out[walk])
                walk = out >= self.n
        return out.astype(np.int64)


def part_bounds(batch: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of ``rank``'s contiguous part of a global batch of ``batch`` among ``world`` ranks:
    sizes differ by at most one, the first ``batch % world`` ranks take one more; for a world that
    divides the batch these are DistributedBatchSampler's slices."""
    q, m = divmod(batch, world)
    lo = rank * q + min(rank, m)
    return lo, lo + q + (rank < m)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


class DistributedBatchSampler:
    """Yields this dp rank's index batches (int64 tensors of ``local_batch_size``).

    ``iter(sampler)`` yields the remaining steps of the current epoch, starting at
    the sampler's next step (0, or what ``set_epoch`` / ``load_state_dict`` set),
    and advances it; a second ``for`` loop therefore continues with the next epoch.
    The batches are tensors; use ``.tolist()`` to feed a torch DataLoader's
    ``batch_sampler`` (or index a dataset's ``get_batch`` directly).
    """

    def __init__(self, dataset_len: int, global_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True):
        n = _check_int("dataset_len", dataset_len, 1)
        g = _check_int("global_batch_size", global_batch_size, 1)
        dp_size = _check_int("dp_size", dp_size, 1)
        dp_rank = _check_int("dp_rank", dp_rank, 0)
        seed = _check_int("seed", seed, 0)
        if dp_rank >= dp_size:
            raise ConfigError(f"dp_rank {dp_rank} out of range for dp_size {dp_size} (need 0 <= dp_rank < dp_size)")
        if g % dp_size != 0:
            lo = (g // dp_size) * dp_size
            hi = lo + dp_size
            fix = f"{lo} or {hi}" if lo > 0 else f"{hi}"
            raise ConfigError(
                f"global_batch_size {g} is not divisible by dp_size {dp_size}: every rank must take the same "
                f"number of samples; use a global_batch_size that is a multiple of {dp_size} (e.g. {fix}) "
                f"or a dp_size that divides {g}"
            )
        if g > n:
            raise ConfigError(
                f"global_batch_size {g} is larger than the dataset ({n} items): with drop_last an epoch would "
                f"have no step; use global_batch_size <= {n}"
            )
        self.dataset_len = n
        self.global_batch_size = g
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = bool(shuffle)
        self.local_batch_size = g // dp_size
        self.steps_per_epoch = n // g
        self._next_step = 0
        self._perm_cache: tuple[int, FeistelPermutation] | None = None

    # ---------------------------------------------------------------- pure functions of the step
    def order(self, epoch: int, start: int, stop: int) -> torch.Tensor:
        """Positions ``start .. stop - 1`` of epoch ``epoch``'s order: their dataset indices (int64)."""
        epoch = _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return torch.arange(start, stop, dtype=torch.long)
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            self._perm_cache = (epoch, FeistelPermutation(self.dataset_len, self.seed, epoch))
        return torch.from_numpy(self._perm_cache[1](np.arange(start, stop)))

    def permutation(self, epoch: int) -> torch.Tensor:
        """The whole order of epoch ``epoch`` (int64, dataset_len entries: for inspection; steps ask only
        for their own positions)."""
        return self.order(epoch, 0, self.dataset_len)

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def global_batch(self, step: int) -> torch.Tensor:
        """All ``global_batch_size`` indices of global step ``step`` (same for every dp_size)."""
        step = _check_int("step", step, 0)
        epoch, k = divmod(step, self.steps_per_epoch)
        g = self.global_batch_size
        return self.order(epoch, k * g, (k + 1) * g)

    def batch(self, step: int) -> torch.Tensor:
        """This rank's ``local_batch_size`` indices of global step ``step``."""
        lb = self.local_batch_size
        return self.global_batch(step)[self.dp_rank * lb:(self.dp_rank + 1) * lb].clone()

    def part(self, step: int, dp_rank: int, dp_size: int, unit: int = 1) -> torch.Tensor:
        """Replica ``dp_rank`` of ``dp_size``'s contiguous part of global step ``step`` (sizes differ by at
        most one: :func:`part_bounds`); equal to ``batch(step)`` of a sampler built with that rank and size
        when ``dp_size`` divides the global batch. ``unit``: the batch is shared in whole units of this many
        samples (it must divide the batch), so parts differ by at most one unit."""
        if self.global_batch_size % unit:
            raise ConfigError(f"part: a unit of {unit} samples does not divide the global batch of "
                              f"{self.global_batch_size}")
        lo, hi = part_bounds(self.global_batch_size // unit, dp_size, dp_rank)
        return self.global_batch(step)[lo * unit:hi * unit].clone()

    def batches(self, start_step: int = 0, num_steps: int | None = None) -> Iterator[torch.Tensor]:
        """This rank's batches of steps ``start_step, start_step + 1, ...`` across epochs
        (endless when ``num_steps`` is None). Does not touch the iterator state."""
        start_step = _check_int("start_step", start_step, 0)
        step = start_step
        while num_steps is None or step < start_step + num_steps:
            yield self.batch(step)
            step += 1

    # ---------------------------------------------------------------- torch-style iteration
    def __len__(self) -> int:
        return self.steps_per_epoch

    def set_epoch(self, epoch: int) -> None:
        """Position the iterator at the first step of ``epoch``."""
        self._next_step = _check_int("epoch", epoch, 0) * self.steps_per_epoch

    @property
    def epoch(self) -> int:
        return self._next_step // self.steps_per_epoch

    @property
    def step(self) -> int:
        """The global step of the next batch the iterator yields."""
        return self._next_step

    def __iter__(self) -> Iterator[torch.Tensor]:
        end = (self._next_step // self.steps_per_epoch + 1) * self.steps_per_epoch
        while self._next_step < end:
            s = self._next_step
            self._next_step = s + 1  # advance before yielding: state_dict() after a batch resumes after it
            yield self.batch(s)

    def state_dict(self) -> dict:
        return {"step": self._next_step, "seed": self.seed, "global_batch_size": self.global_batch_size,
                "dataset_len": self.dataset_len, "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        """Resume at ``state["step"]``; dp_rank/dp_size may differ from the saving run
        (the global batches do not depend on them), but seed, global_batch_size,
        dataset_len and shuffle must match."""
        for key in ("seed", "global_batch_size", "dataset_len", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}; resuming would not reproduce the run"
                )
        self._next_step = _check_int("step", state["step"], 0)

    def __repr__(self) -> str:
        return (f"DistributedBatchSampler(dataset_len={self.dataset_len}, global_batch_size={self.global_batch_size}, "
                f"dp_rank={self.dp_rank}, dp_size={self.dp_size}, seed={self.seed}, shuffle={self.shuffle}, "
                f"steps_per_epoch={self.steps_per_epoch}, step={self._next_step})")
