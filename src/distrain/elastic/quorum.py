"""The quorum's decisions: which survivors go on, and from which step, as pure functions of their offers.

The coordinator (coordinator.py) gathers every live member's offer at an epoch change (``arrive/E+1/ID``:
its live step, its start-of-step copy, for ZeRO its pieces, its last checkpoint) and asks these functions:

* :func:`replicated_target` / :func:`sharded_target`: the step to go on from (replicated state: the latest
  boundary every survivor can reach; sharded state: the latest step whose pieces make a whole layout, else
  the last checkpoint);
* :func:`whole_replicas`: with tp/pp, only survivors whose model replica is whole stay;
* :func:`rolled_back`: whether the step under way is redone;
* :func:`refusal`: the one line a rank that comes back with a stale state (or another run's) gets.

No store, no process, no clock: every rule here is tested on plain dicts (tests/test_elastic.py).
"""

from __future__ import annotations

from distrain.elastic.protocol import FROZEN_S
from distrain.errors import TrainingError


def whole_replicas(members: list[int], keep: list[int], tp: int, pp: int) -> list[int]:
    """The ids of ``keep`` whose model replica (the dp index of their position in ``members`` on the
    dp x tp x pp grid, distrain.topology's order: position = pp_rank * dp * tp + dp_rank * tp + tp_rank) is
    whole in ``keep``. Kept in ``members`` order, so every survivor keeps its (tp, pp) coordinate on
    the smaller grid, and holds the shard it had."""
    dp = len(members) // (tp * pp)
    replica = {i: (k % (dp * tp)) // tp for k, i in enumerate(members)}
    broken = {replica[i] for i in members if i not in keep}
    return [i for i in members if i in keep and replica[i] not in broken]


def reachable(offer: dict) -> set[int]:
    """The step boundaries a survivor can go on from: its live state's, its copy's, and (replicated state,
    ready) the one after its live one, which it reaches by applying the step's update itself."""
    return {s for s in (offer["live"], offer.get("next"), offer["snap"]) if s is not None}


def replicated_target(offers: dict[int, dict]) -> int:
    """The step a job with replicated state goes on from: the latest live boundary when every survivor can
    reach it or every survivor holds the whole state (a survivor's update of the step was applied: its
    commit completed. With the commit its own all-reduce, every rank entered it and holds the step's
    synchronised gradients: the others roll forward themselves; riding with the gradients, a survivor may
    be behind, and it gets the step's state from one that holds it), else the smallest one (the step under
    way is redone from its start, which every survivor still holds)."""
    hi = max(r["live"] if r["live"] is not None else r["snap"] for r in offers.values())
    if all(hi in reachable(r) for r in offers.values()) or all(r.get("whole") for r in offers.values()):
        return hi
    return min(r["live"] if r["live"] is not None else r["snap"] for r in offers.values())


def rolled_back(target: int, kept: list[dict], sharded: bool) -> int | None:
    """``target`` when the step from ``target`` was under way on a kept survivor and is redone, else None."""
    if sharded:
        return target if any(r["live"] != target for r in kept) else None
    return target if any(r.get("in_step") and r["live"] == target for r in kept) else None


def sharded_target(offers: dict[int, dict]) -> tuple[int, str]:
    """The step a job with sharded state (ZeRO) goes on from, and where its state comes from.

    Each survivor offers pieces ``[step, world, rank, kind]``: its own piece of a layout of
    ``world`` ranks (kind "own", at its live boundary and at its start-of-step copy), and its
    predecessor's (kind "replica"). A step is possible when the pieces at it cover ranks
    0..world-1 of one layout (the survivors then gather them: none needs its own state at that
    step); the latest possible step is taken ("peers", or "replicas" when a piece comes from a
    replica only). None possible (a rank and its successor lost at once): the last checkpoint
    every survivor knows ("checkpoint"); none written yet: TrainingError."""
    steps = sorted({p[0] for r in offers.values() for p in r["pieces"]}, reverse=True)
    for t in steps:
        own, held = set(), set()
        for r in offers.values():
            for step, world, rank, kind in r["pieces"]:
                if step == t:
                    (own if kind == "own" else held).add((world, rank))
        for world in {w for w, _ in own | held}:
            if all((world, k) in own | held for k in range(world)):
                return t, "peers" if all((world, k) in own for k in range(world)) else "replicas"
    ckpts = [r.get("ckpt") for r in offers.values()]
    if any(c is None for c in ckpts):
        world = max(p[1] for r in offers.values() for p in r["pieces"]) if steps else 0
        gone = sorted(set(range(world)) - {p[2] for r in offers.values() for p in r["pieces"] if p[1] == world})
        raise TrainingError(f"elastic: the piece(s) of ZeRO rank(s) {gone} of {world} were lost with their "
                            f"replicas (a rank and its successor at once) and no checkpoint was written yet; the job "
                            f"cannot go on: set --ckpt-every to have a checkpoint to fall back on")
    return min(ckpts), "checkpoint"


def refusal(ident: int, offer: dict, run_id: str, group_step: int | None, frozen: bool = False) -> str:
    """The one line a rank coming back with a stale state gets: another run's, or an older step."""
    if offer.get("run", run_id) != run_id:
        return (f"elastic: rank id {ident} refused: its state is of run {offer.get('run')}, the group's of run "
                f"{run_id}; a rank cannot join another run")
    step = offer["live"] if offer.get("live") is not None else offer.get("snap")
    group = f"at step {group_step}" if group_step is not None else "before its first completed step"
    how = f"frozen: no heartbeat for {FROZEN_S:g}s" if frozen else "silent past --collective-timeout"
    return (f"elastic: rank id {ident} refused: its state is at step {step}, the group's {group}; "
            f"it was dropped ({how}) and cannot rejoin with a stale state")
