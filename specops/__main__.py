"""`python -m specops`: the command line (specops/cli.py)."""

import sys

from specops.cli import main

sys.exit(main())
