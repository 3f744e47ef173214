"""`python -m fxsched`: the `fxsched` command (cli.py)."""

import sys

from .cli import main

sys.exit(main())
