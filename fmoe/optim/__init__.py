"""Pure optimizers over parameter trees (optax-style) and the helpers around them.

- :mod:`fmoe.optim.adamw`: ``state = adamw.init(params)``, ``params, state = adamw.update(grads,
  state, params, lr=...)`` (the trainer's AdamW; ``adamw.step`` also returns its statistics);
- :mod:`fmoe.optim.masks`: freeze a subtree by glob (``mask``, ``partition`` / ``combine``,
  ``freeze``);
- :mod:`fmoe.optim.schedule`: ``lr_at`` (warmup + cosine).

Example:
    >>> import torch, fmoe
    >>> p = {"w": torch.zeros(2)}
    >>> p, s = fmoe.optim.adamw.update({"w": torch.ones(2)}, fmoe.optim.adamw.init(p), p, lr=0.1)
    >>> p["w"].tolist()
    [-0.10000000149011612, -0.10000000149011612]
"""

from . import adamw, masks, schedule
from .adamw import AdamWConfig
from .masks import combine, freeze, mask, matches, partition
from .schedule import lr_at

__all__ = ["adamw", "masks", "schedule", "AdamWConfig", "mask", "matches", "partition", "combine", "freeze", "lr_at"]
