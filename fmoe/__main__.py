"""``python -m fmoe <command>``: the programs of :mod:`fmoe.cli` (the same as the ``fmoe`` script)."""

import sys

from fmoe.cli import main

sys.exit(main())
