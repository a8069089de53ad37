"""``python -m distrain ...``: the same as the ``distrain`` command."""

import sys

from distrain.cli import main

sys.exit(main())
