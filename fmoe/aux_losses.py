"""Former home of :mod:`fmoe.routing.aux_losses` (router losses on global statistics); kept so
that ``fmoe.aux_losses`` and ``from fmoe.aux_losses import ...`` keep working."""

from .routing.aux_losses import *  # noqa: F403
from .routing.aux_losses import __all__  # noqa: F401
