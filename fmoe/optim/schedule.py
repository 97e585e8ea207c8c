"""Learning-rate schedules: a pure function of the step number.

Example:
    >>> round(lr_at(1, 1.0, 2, 10), 3)
    0.5
"""

from __future__ import annotations

import math

__all__ = ["lr_at"]


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay to ``min_ratio * base_lr`` at ``total``.

    ``step`` counts from 1 (the first update).

    Example:
        >>> [round(lr_at(s, 1.0, 2, 10), 3) for s in (1, 2, 10)]
        [0.5, 1.0, 0.1]
    """
    if step <= warmup:
        return base_lr * step / max(1, warmup)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
