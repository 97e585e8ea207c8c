"""Step directories: the one rule for the names of a run's training checkpoints.

A run directory ``OUT`` holds its checkpoints as ``OUT/step-N`` (``N`` the optimizer step, a
non-negative integer), each written first into a temporary ``OUT/.step-N.tmp-<pid>-<random>``
(:func:`fmoe.checkpoint.atomic.begin`) and renamed into place when complete. Everything that
finds, lists or cleans checkpoints reads names through these functions, so the pattern is
written once.

Example:
    >>> step_dir("runs/a", 12)
    'runs/a/step-12'
    >>> step_of("step-12"), step_of("step-x"), step_of(".step-12.tmp-7-ab")
    (12, None, None)
    >>> is_step_temporary(".step-12.tmp-7-ab"), is_step_temporary("step-12")
    (True, False)
"""

from __future__ import annotations

import os
import re
from typing import Optional

__all__ = ["step_dir", "step_of", "is_step_temporary"]

_STEP = re.compile(r"step-(\d+)")
_TEMPORARY = re.compile(r"\.step-\d+\.tmp(-.*)?")


def step_dir(out: str, step: int) -> str:
    """The checkpoint directory of ``step`` in run directory ``out``: ``out/step-{step}``."""
    return os.path.join(out, f"step-{step}")


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name (``"step-12"`` -> 12), None for any other name."""
    m = _STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def is_step_temporary(name: str) -> bool:
    """Whether ``name`` is an unfinished save's temporary (``.step-N.tmp`` or ``.step-N.tmp-*``)."""
    return _TEMPORARY.fullmatch(name) is not None
