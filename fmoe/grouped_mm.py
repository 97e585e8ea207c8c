"""Former home of the grouped-GEMM operators, now :mod:`fmoe.experts.ops` (expert compute has one
home, :mod:`fmoe.experts`). Kept so that imports of ``fmoe.grouped_mm`` keep working."""

from .experts.ops import *  # noqa: F403
from .experts.ops import __all__, _grouped_mm_op, _grouped_wgrad_op  # noqa: F401
