"""Former name of :mod:`fmoe.global_stats` (the module holds the general ``GlobalStat``, not only
load statistics). Kept so that ``fmoe.load_stats.GlobalStat`` and friends keep working."""

from .global_stats import *  # noqa: F403
from .global_stats import __all__  # noqa: F401
