"""What a process of a job is and how it ends, without torch: :func:`launched_rank` and :func:`leave`.

Every command's entry point (distrain.cli) asks both, so they import no torch: a command that never
touches torch (``distrain --version``, ``cluster up|down|status|link``, ``secret``) does not pay
``import torch`` (about 1.7 s of CPU per process on the 2-core host). :mod:`distrain.runtime` re-exports
both, with the process's own environment as ``launched_rank``'s default (the environment is read at the
process's edge, never here).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Mapping, NoReturn

from distrain.errors import ConfigError


def env_int(name: str, environ: Mapping[str, str]) -> int:
    """``environ[name]`` as an integer; ConfigError naming the variable when it is not one."""
    try:
        return int(environ[name])
    except ValueError:
        raise ConfigError(f"environment variable {name}={environ[name]!r} is not an integer") from None


def launched_rank(environ: Mapping[str, str]) -> tuple[int, int] | None:
    """(rank, world size) when a launcher (``distrain launch``, torchrun, ``distrain cluster run``,
    ``distrain.spawn``) started this process as one rank of a job, i.e. ``environ`` holds both RANK and
    WORLD_SIZE; None for a top process (one that spawns its ranks, or runs alone). ConfigError when either
    is not an integer. (:func:`distrain.runtime.launched_rank` reads the process's own environment.)"""
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    return env_int("RANK", environ), env_int("WORLD_SIZE", environ)


def leave(code: int) -> NoReturn:
    """End this process with exit status ``code`` without interpreter finalization.

    Runs the atexit callbacks (:func:`distrain.runtime.shutdown` among them when the process initialised a
    group, and logging's), flushes stdout and stderr, then ``os._exit``: what multiprocessing does at the
    end of a child, so a C++ thread that still holds a finished collective's tensors can never ask for the
    GIL during finalization (see distrain.runtime's docstring). For the command-line entry points."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced: nothing left to flush
            pass
    os._exit(code)
