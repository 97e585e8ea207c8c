"""Training: the main job CLI (``python -m fmoe.train``, or :func:`run` with the same settings
as keywords). The train step, gradient reduction and evaluation are library modules of
:mod:`fmoe.training`; AdamW is :mod:`fmoe.optim`; sharded training checkpoints are
:mod:`fmoe.checkpoint.training`."""

from .api import run

__all__ = ["run"]
