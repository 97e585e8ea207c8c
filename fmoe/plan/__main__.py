"""``python -m fmoe.plan``: hands over to the memory-plan program, :mod:`fmoe.memplan.cli`
(the command keeps its name; the sharding ``Plan`` of this package imports nothing above it)."""

import sys

from ..memplan.cli import main

sys.exit(main())
