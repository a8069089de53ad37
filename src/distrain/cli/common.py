"""What every ``distrain`` subcommand shares: exit codes, the one-line error, settings files.

Exit codes: 0 done, :data:`ERROR` (2) for a refused command (a :class:`~distrain.errors.DistrainError`,
printed as one line ``distrain: error: MESSAGE`` on stderr, as argparse prints its own usage
errors), :data:`INTERRUPTED` (130) after Ctrl-C, 128 + the signal's number after SIGTERM/SIGHUP
(:func:`signalled`). A subcommand's own status (e.g. ``cluster run``'s, ``bench tp``'s 1 on a
mismatch) passes through unchanged.
"""

from __future__ import annotations

import sys

from distrain.errors import ConfigError

ERROR = 2  # a refused command: bad flags or settings, a missing file (argparse uses 2 too)
INTERRUPTED = 130  # Ctrl-C: 128 + SIGINT, as a shell reports it


def error(message) -> int:
    """Print ``distrain: error: MESSAGE`` on stderr (one line); the exit code, :data:`ERROR`."""
    print(f"distrain: error: {message}", file=sys.stderr)
    return ERROR


def interrupted() -> int:
    """Ctrl-C: say that the ranks were stopped; the exit code, :data:`INTERRUPTED`."""
    print("distrain: interrupted (Ctrl-C); every rank was stopped", file=sys.stderr)
    return INTERRUPTED


def signalled(stopped) -> int:
    """SIGTERM/SIGHUP (a :class:`distrain.lifeline.Stopped`): say so; the exit code, 128 + its number."""
    print(f"distrain: {stopped}; every rank was stopped", file=sys.stderr)
    return 128 + stopped.signum


def read_toml(path: str, prefix: str = "") -> dict:
    """The settings of ``--config path`` (a TOML file); a one-line ConfigError, starting with
    ``prefix``, when Python has no tomllib or the file cannot be read or parsed."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        raise ConfigError(f"{prefix}--config needs Python >= 3.11 (tomllib); give the settings as flags "
                          f"instead") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"{prefix}--config {path}: cannot read it ({e.strerror})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{prefix}--config {path}: not valid TOML ({e})") from None
