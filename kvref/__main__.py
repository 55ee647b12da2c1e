"""``python -m kvref``: the same command line as the ``kvref`` console script."""

import sys

from .jobs.cli import main

sys.exit(main())
