"""``python -m distrain.cli ...``: the same as the ``distrain`` command (launched ranks start this way)."""

from distrain.cli import run_command

run_command()
