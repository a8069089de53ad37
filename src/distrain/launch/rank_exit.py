"""The exit status of a launched rank's command, computed as the interpreter would.

The command-line entry points of launched ranks (``distrain.cli.run_command``,
``distrain.cluster.command``) end through :func:`distrain.runtime.leave`, not interpreter exit,
so they compute the status themselves: :func:`exit_status`.
"""

from __future__ import annotations

import sys

__all__ = ["exit_status"]


def exit_status(fn, *args) -> int:
    """``fn(*args)``'s exit status as the interpreter would compute it (SystemExit, uncaught exception)."""
    import traceback

    try:
        code = fn(*args)
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then status 1
        traceback.print_exc()
        return 1
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1
