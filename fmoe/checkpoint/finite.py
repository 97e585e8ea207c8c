"""Nothing non-finite is saved or loaded: :func:`first_nonfinite` names the first leaf of a
training state whose local shard holds a NaN/Inf, in one fused pass over every floating leaf and
one host read, and :class:`NonFiniteState` is what a save refuses with
(:func:`fmoe.checkpoint.training.save`: the last good checkpoint stays the latest).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import tree as _tree
from ..sharding import local_shard

__all__ = ["NonFiniteState", "first_nonfinite"]


class NonFiniteState(RuntimeError):
    """The training state holds NaN/Inf: :func:`save` writes nothing (the last good checkpoint stays)."""


def first_nonfinite(tree: Any) -> Optional[str]:
    """The path of the first leaf whose local shard holds a NaN/Inf, or None: one fused pass (the
    2-norm of every floating leaf by ``torch._foreach_norm``, NaN and Inf propagating) and one host
    read; only a leaf whose norm is not finite (a NaN/Inf, or values so large their squares
    overflow) is then checked element by element.

    Example:
        >>> first_nonfinite({"a": torch.full((2,), 1e30), "b": {"c": torch.tensor([1.0, float("inf")])}})
        'b.c'
    """
    flat = [(p, local_shard(leaf)) for p, leaf in _tree.flatten(tree).items()]
    flat = [(p, t) for p, t in flat if t.is_floating_point() and t.numel()]
    if not flat:
        return None
    with torch.no_grad():
        norms = torch.stack([n.float() for n in torch._foreach_norm([t for _, t in flat], 2)])
        suspects = (~torch.isfinite(norms)).nonzero().flatten().tolist()
        return next((flat[i][0] for i in suspects if not bool(torch.isfinite(flat[i][1]).all())), None)
