"""Former home of the blocked CPU expert path, now :mod:`fmoe.experts.blocked` (expert compute has
one home, :mod:`fmoe.experts`). Kept so that imports of ``fmoe.expert_blocks`` keep working."""

from .experts.blocked import *  # noqa: F403
from .experts.blocked import BLOCK_ROWS, __all__  # noqa: F401
