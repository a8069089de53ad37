"""Silent data corruption across replicas: ``--check-replicas N`` and the ``DISTRAIN_INJECT`` bit flip.

Ranks that hold the same state (an engine's ``replica_group``: our DDP's data-parallel replicas, the
dp x cp group of one (tp, pp) shard with --tp/--pp) must hold it bit for bit: they start from the same
seeded model and apply the same averaged gradient with the same optimizer. A bit that flips in one
rank's memory (a bad DIMM, a faulty core, an SDC in an accelerator) is invisible to the loss, yet is
averaged into nothing: it stays in that replica and, from the next checkpoint on, in the run.

:func:`digest` hashes the raw bytes of every tensor of :meth:`Engine.replica_state` (parameters, then
the optimizer's state, in a fixed order) with SHA-256, cut to 16 bytes; :func:`mismatched` all-gathers the
digests over the replica group as one uint8 tensor per rank (nothing from another rank is unpickled)
and names the ranks whose bits differ: with 3 or more copies those outside the majority (a digest held
by more than half of them), else (2 copies, or no majority) every rank. The loop
(trainer/loop.py) runs the check every N steps and before every checkpoint write, and stops the job
with :class:`~distrain.errors.ReplicaMismatchError` on a mismatch, so no checkpoint written after a
corruption is ever committed.

``DISTRAIN_INJECT=bitflip:STEP:RANK`` (read at the process edge: distrain.runtime.injected_fault;
parsed by :func:`parse_inject`) makes rank RANK flip one bit right after step STEP's optimizer update
(:func:`flip_bit`: the lowest bit of the first element of the first tensor of its replica state, the
first parameter; for a float, its lowest mantissa bit, which changes the value whatever it is).
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from distrain import comm
from distrain.errors import ConfigError, ReplicaMismatchError

DIGEST_BYTES = 16
INJECT_FORM = "bitflip:STEP:RANK"
# the integer dtype of each element size: a float's bits, seen as an integer, to flip one of them
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class BitFlip:
    """Flip one bit on ``rank`` right after the optimizer update of step ``step`` (0-based)."""
    step: int
    rank: int


def parse_inject(text: str | None) -> BitFlip | None:
    """``"bitflip:STEP:RANK"`` -> BitFlip(STEP, RANK); None or "" -> None; anything else a one-line ConfigError."""
    if not text:
        return None
    m = re.fullmatch(r"bitflip:(\d+):(\d+)", text.strip())
    if m is None:
        raise ConfigError(f"DISTRAIN_INJECT={text!r} is not {INJECT_FORM} (two integers >= 0, e.g. bitflip:3:1); "
                          f"fix it or unset DISTRAIN_INJECT")
    return BitFlip(int(m[1]), int(m[2]))


def check_inject(flip: BitFlip | None, cfg) -> BitFlip | None:
    """``flip`` when it fits the run ``cfg`` (a rank of the job, a step it runs, a strategy whose ranks
    hold replicas), else a one-line ConfigError."""
    if flip is None:
        return None
    where = f"DISTRAIN_INJECT=bitflip:{flip.step}:{flip.rank}"
    if flip.rank >= cfg.nproc:
        raise ConfigError(f"{where}: rank {flip.rank} is not a rank of this job (--nproc {cfg.nproc}); "
                          f"give a rank below {cfg.nproc}")
    if flip.step >= cfg.steps:
        raise ConfigError(f"{where}: step {flip.step} is not a step of this run (--steps {cfg.steps}: steps 0.."
                          f"{cfg.steps - 1}); give an earlier step")
    why = no_replicas(cfg)
    if why:
        raise ConfigError(f"{where}: flips a bit of one replica, but {why}; use --strategy ddp")
    return flip


def no_replicas(cfg) -> str | None:
    """Why the ranks of ``cfg`` hold no replicas whose bits --check-replicas can compare, or None when they do."""
    if cfg.strategy == "single":
        return "--strategy single runs one process: there is no replica to compare with"
    if cfg.strategy.startswith("zero"):
        return (f"--strategy {cfg.strategy}: each ZeRO rank holds a different shard of the optimizer state "
                f"(and with zero3 of the parameters)")
    if cfg.strategy.startswith("ps-"):
        return (f"--strategy {cfg.strategy}: the state lives on the parameter servers, each a different shard "
                f"(a worker's copy is a pull, not state)")
    if cfg.strategy in ("torch-ddp", "local"):
        return (f"--strategy {cfg.strategy} is a benchmark baseline" +
                (" whose ranks train unsynchronised replicas" if cfg.strategy == "local" else ""))
    if cfg.strategy == "diloco":
        return "--strategy diloco: each island keeps its own inner optimizer state (and, between syncs, parameters)"
    if cfg.ep > 1:
        return f"--ep {cfg.ep}: the expert-parallel ranks of a replica group hold different experts"
    if cfg.dp_size * cfg.cp < 2:
        return f"the layout holds one replica of each shard (dp {cfg.dp_size} x cp {cfg.cp})"
    if cfg.elastic:
        return "--elastic re-forms the replica group when ranks come and go"
    return None


def flip_bit(t: torch.Tensor) -> None:
    """Flip, in place, the lowest bit of ``t``'s first element (its raw bytes seen as an integer of
    the element's size): for a float, the lowest mantissa bit, so the value always changes (by one
    unit in the last place; 0.0 becomes the smallest subnormal)."""
    if t.numel() == 0 or not t.is_contiguous():
        raise ConfigError(f"DISTRAIN_INJECT: cannot flip a bit of an empty or non-contiguous tensor {tuple(t.shape)}")
    with torch.no_grad():
        t.detach().view(-1)[:1].view(_BITS[t.element_size()]).bitwise_xor_(1)


def digest(tensors) -> bytes:
    """SHA-256, its first 16 bytes, of every tensor's dtype, shape and raw bytes, in the order given:
    equal exactly when every tensor is equal bit for bit (but with chance 2**-128). SHA-256 rather than
    BLAKE2b: hashlib's SHA-256 is OpenSSL's, which uses the CPU's SHA instructions (x86 SHA-NI, ARMv8
    SHA2) where they exist: 10.4 MB in 5.9 ms against BLAKE2b's 11.1 ms on the machine of the measurement
    in docs/fault_tolerance.md, and the hash is the check's cost."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy())  # (a buffer: hashed without a copy)
    return h.digest()[:DIGEST_BYTES]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's state in a fixed order: per parameter (its param_groups' order), each state
    entry by name; a number that is not a tensor (some optimizers keep the step so) as a float64."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            for k in sorted(state):
                v = state[k]
                out.append(v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64))
    return out


def disagreeing(digests: list[bytes]) -> list[int]:
    """The indices of ``digests`` whose bits differ: [] when all are equal; else, with 3 or more
    copies, those outside the majority (a digest more than half of them hold); without one (2
    copies, or no digest held by more than half) every index."""
    if len(set(digests)) <= 1:
        return []
    common = max(set(digests), key=digests.count)
    if len(digests) >= 3 and 2 * digests.count(common) > len(digests):
        return [i for i, d in enumerate(digests) if d != common]
    return list(range(len(digests)))


def mismatched(tensors, group) -> tuple[list[int], list[int]]:
    """Collective over ``group``: (the group's global ranks, those whose digest of ``tensors`` differs:
    :func:`disagreeing`). Every rank of the group gets the same answer."""
    mine = torch.frombuffer(bytearray(digest(tensors)), dtype=torch.uint8)
    ranks = dist.get_process_group_ranks(group)
    got = [torch.empty(DIGEST_BYTES, dtype=torch.uint8) for _ in ranks]
    comm.all_gather(got, mine, group=group)
    return ranks, [ranks[i] for i in disagreeing([bytes(g.tolist()) for g in got])]


def mismatch_message(step: int, ranks: list[int], bad: list[int], kept: int | None, out: str) -> str:
    """The one line of ReplicaMismatchError: the step, the ranks whose bits differ, the checkpoint kept."""
    names = ", ".join(map(str, bad))
    if len(bad) < len(ranks):
        who = (f"rank{'s' * (len(bad) > 1)} {names} hold{'s' * (len(bad) == 1)} other parameters and optimizer "
               f"state than the majority of {'their' if len(bad) > 1 else 'its'} {len(ranks)} replicas (ranks "
               f"{', '.join(map(str, ranks))})")
    else:
        who = f"ranks {names} hold different parameters and optimizer state ({len(ranks)} replicas, no majority)"
    last = (f"the last good checkpoint is step {kept} in {out} (--resume continues from it)" if kept is not None
            else "no checkpoint was written before it")
    return f"replica check at step {step}: {who}; {last}"


def check_replicas(engine, step: int, kept: int | None, out: str) -> float:
    """Collective over ``engine``'s replica group at step boundary ``step``: its seconds (hash and
    all-gather) when the replicas agree, else ReplicaMismatchError naming the step, the ranks whose bits
    differ and ``kept``, the step of the newest checkpoint committed in ``out`` (None: none)."""
    t0 = time.perf_counter()
    ranks, bad = engine.replica_mismatch()
    if bad:
        raise ReplicaMismatchError(mismatch_message(step, ranks, bad, kept, out))
    return time.perf_counter() - t0
