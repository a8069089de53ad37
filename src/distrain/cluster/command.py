"""Rank side of ``distrain cluster run``: run the user's command inside one torchrun worker.

torchrun parses every argument after its own with abbreviations allowed, so a script flag
such as ``--nproc`` would be taken for torchrun's ``--nproc-per-node``. The command
therefore travels in ``DISTRAIN_CLUSTER_CMD`` (a JSON list) and torchrun only sees
``-m distrain.cluster.command``. Here the command is run in this process:
``distrain ARGS`` -> ``python -m distrain ARGS`` (runpy: the CLI's own entry point,
distrain/__main__.py, with ``sys.argv`` the command as given; this layer does not import the
CLI); ``[python] script.py ARGS`` and ``python -m mod ARGS`` -> runpy; any other program -> exec.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from distrain.cluster.runner import CMD_ENV as ENV


def main() -> int:
    cmd = json.loads(os.environ[ENV])
    head = os.path.basename(cmd[0])
    if head == "distrain":  # what the `distrain` script runs: distrain.__main__, which ends a rank itself
        sys.argv = list(cmd)
        runpy.run_module("distrain", run_name="__main__", alter_sys=False)
        return 0
    if head.startswith("python"):
        cmd = cmd[1:]
        if cmd[:1] == ["-m"]:
            sys.argv = [cmd[1], *cmd[2:]]
            runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            return 0
    if cmd and cmd[0].endswith(".py"):
        sys.argv = list(cmd)
        sys.path.insert(0, os.path.dirname(os.path.abspath(cmd[0])))
        runpy.run_path(cmd[0], run_name="__main__")
        return 0
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":  # a launched rank: leave without interpreter finalization (runtime.leave)
    from distrain import runtime
    from distrain.launch.rank_exit import exit_status

    runtime.leave(exit_status(main))
