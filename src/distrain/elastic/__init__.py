"""Elastic training: a data-parallel job that loses and gains ranks without restarting the others.

``distrain train --elastic MIN:MAX --nproc N --strategy ddp|zero1|zero2|zero3 [--elastic-replace K]``:

    spec.py    the flag: MIN:MAX and the rules a job must meet (refused before any rank starts)
    agent.py   the top process: starts the ranks, hosts the store, decides every new membership
               (who is in, the step to go on from), starts replacements, stops below MIN
    member.py  one rank: a process group per membership epoch, the per-step quorum ("is the group
               still whole?"), roll-back to the start of a step cut in half, healing a newcomer
    pieces.py  state trees: the start-of-step copy, and ZeRO's replica of the previous rank's piece
    sockets.py leaving a broken Gloo group at once (its TCP connections shut down)

The trainer's loop (trainer/loop.py) asks the Member once per step; on a change it builds a new
engine on the new group and loads the state the Member hands it, so engines never see a dead rank.
docs/fault_tolerance.md ("Elastic training") has the design, the numbers and what is left out.
"""

from distrain.elastic.spec import SUPPORTED, check, parse

__all__ = ["SUPPORTED", "check", "parse"]
