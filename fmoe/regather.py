"""Re-gather FSDP weights in backward instead of keeping them alive.

``fmoe.materialize`` all-gathers a weight split over ``fsdp``/``efsdp`` for one layer call.
Autograd would normally save that full weight for the backward matmul, so every layer's full
weights would stay alive until backward — defeating FSDP's memory saving. Inside
:func:`regather_in_backward`, a saved tensor that is (a view of) such a gathered weight is
replaced by a *recipe* — its local shard and process group — and gathered again when the
backward pass unpacks it. Every rank unpacks in the same order (identical graphs), so the
extra collectives line up.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Optional

import torch

from .collectives import all_gather_rows

__all__ = ["register_gathered", "regather_in_backward", "stats"]

_RECIPES: "weakref.WeakValueDictionary[int, _Recipe]" = weakref.WeakValueDictionary()
_STATS = {"packed": 0, "regathered": 0}


class _Recipe:
    __slots__ = ("local", "group", "dim", "full", "__weakref__")

    def __init__(self, local: torch.Tensor, group, dim: int, full: torch.Tensor):
        self.local, self.group, self.dim = local, group, dim
        self.full = weakref.ref(full)


def register_gathered(full: torch.Tensor, local: torch.Tensor, group, dim: int) -> None:
    """Remember that ``full`` is ``local`` all-gathered over ``group`` along ``dim``
    (equal pieces, concatenated in rank order)."""
    recipe = _Recipe(local.detach(), group, dim, full)
    full._fmoe_recipe = recipe  # type: ignore[attr-defined]  (keeps the recipe alive with full)
    _RECIPES[full.untyped_storage().data_ptr()] = recipe


def _lookup(t: torch.Tensor) -> Optional[_Recipe]:
    ptr = t.untyped_storage().data_ptr()
    recipe = _RECIPES.get(ptr)
    if recipe is None:
        return None
    full = recipe.full()
    if full is None or full.untyped_storage().data_ptr() != ptr:   # storage reused by another tensor
        return None
    return recipe


def _pack(t: torch.Tensor) -> Any:
    recipe = _lookup(t) if t.numel() else None
    if recipe is None:
        return t
    _STATS["packed"] += 1
    return (recipe, tuple(t.shape), t.stride(), t.storage_offset())


def _unpack(obj: Any) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    recipe, shape, stride, offset = obj
    _STATS["regathered"] += 1
    out = all_gather_rows(recipe.local.movedim(recipe.dim, 0).contiguous(), recipe.group)
    return out.as_strided(shape, stride, offset)   # same layout as the storage gathered in forward


@contextlib.contextmanager
def regather_in_backward():
    """Context in which gathered FSDP weights are saved as recipes and re-gathered in backward.

    Example:
        >>> with regather_in_backward():
        ...     pass
    """
    with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
        yield


def stats() -> dict:
    """Counters: saved tensors replaced by recipes, and re-gathers performed (for tests)."""
    return dict(_STATS)
