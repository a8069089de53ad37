"""``python -m distrain ...``: the same as the ``distrain`` command."""

from distrain.cli import run_command

run_command()
