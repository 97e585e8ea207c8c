"""``python -m fmoe.train``: see :mod:`fmoe.train.cli`."""

import sys

from .cli import main

sys.exit(main())
