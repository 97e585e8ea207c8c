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
from typing import Any, Optional, Sequence

import torch

from .collectives import all_gather_rows
from .transforms import active as transforms_active

__all__ = ["register_gathered", "register_gathered_group", "gather_flat", "regather_in_backward", "stats"]

_RECIPES: "weakref.WeakValueDictionary[int, _Recipe]" = weakref.WeakValueDictionary()
_STATS = {"packed": 0, "regathered": 0, "gathers": 0}


def gather_flat(locals_: Sequence[torch.Tensor], dims: Sequence[int], group,
                like: Optional[Sequence[tuple]] = None) -> list[torch.Tensor]:
    """Every rank's ``locals_[i]`` concatenated along ``dims[i]``, for all ``i`` in ONE all-gather
    (equal pieces, rank order; not differentiable). ``like[i]`` = ``(stride, storage_offset,
    storage_numel)`` lays result ``i`` out exactly like an earlier gathered tensor."""
    flat = torch.cat([t.reshape(-1) for t in locals_])
    out = all_gather_rows(flat, group).view(-1, flat.numel())                     # [n, total]
    n, fulls, start = out.shape[0], [], 0
    for i, (t, d) in enumerate(zip(locals_, dims)):
        pieces = out[:, start:start + t.numel()].reshape(n, *t.shape)             # [n, *local]
        start += t.numel()
        shape = list(t.shape)
        shape[d] *= n
        if like is None:
            full = t.new_empty(shape)
        else:
            stride, offset, numel = like[i]
            full = t.new_empty(numel).as_strided(shape, stride, offset)
        for r in range(n):
            full.narrow(d, r * t.shape[d], t.shape[d]).copy_(pieces[r])
        fulls.append(full)
    return fulls


class _Recipe:
    """Local shards of tensors gathered together (one collective): how to gather them again.
    The first unpack of any member re-gathers all of them (each in its forward memory layout,
    so saved views keep their strides); the copies live until every saved reference has been
    unpacked."""

    __slots__ = ("locals", "group", "dims", "fulls", "layouts", "cache", "pending", "__weakref__")

    def __init__(self, locals_: Sequence[torch.Tensor], group, dims: Sequence[int], fulls: Sequence[torch.Tensor]):
        self.locals, self.group, self.dims = [t.detach() for t in locals_], group, list(dims)
        self.fulls = [weakref.ref(f) for f in fulls]
        self.layouts = [(f.stride(), f.storage_offset(), f.untyped_storage().nbytes() // f.element_size())
                        for f in fulls]
        self.cache: Optional[list] = None
        self.pending = 0

    def unpack(self, i: int) -> torch.Tensor:
        if self.cache is None:
            _STATS["gathers"] += 1
            self.cache = gather_flat(self.locals, self.dims, self.group, like=self.layouts)
        out = self.cache[i]
        self.pending -= 1
        if self.pending <= 0:
            self.cache = None
        return out


def register_gathered_group(fulls: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], group,
                            dims: Sequence[int]) -> None:
    """Remember that each ``fulls[i]`` is ``locals_[i]`` all-gathered over ``group`` along
    ``dims[i]`` (equal pieces, rank order), all in one collective: backward re-gathers them the
    same way. Not under torch.func transforms or compile (wrapped tensors have no storage to
    key on): there the gathered copies are simply kept for backward."""
    if transforms_active():
        return
    recipe = _Recipe(locals_, group, dims, fulls)
    for i, full in enumerate(fulls):
        full._fmoe_recipe = (recipe, i)  # type: ignore[attr-defined]  (keeps the recipe alive with full)
        _RECIPES[full.untyped_storage().data_ptr()] = recipe


def register_gathered(full: torch.Tensor, local: torch.Tensor, group, dim: int) -> None:
    """Remember that ``full`` is ``local`` all-gathered over ``group`` along ``dim``
    (equal pieces, concatenated in rank order)."""
    register_gathered_group([full], [local], group, [dim])


def _lookup(t: torch.Tensor) -> Optional[tuple[_Recipe, int]]:
    ptr = t.untyped_storage().data_ptr()
    recipe = _RECIPES.get(ptr)
    if recipe is None:
        return None
    for i, ref in enumerate(recipe.fulls):
        full = ref()
        if full is not None and full.untyped_storage().data_ptr() == ptr:
            return recipe, i
    return None                                                    # storage reused by another tensor


def _pack(t: torch.Tensor) -> Any:
    found = _lookup(t) if t.numel() and _RECIPES else None
    if found is None:
        return t
    _STATS["packed"] += 1
    found[0].pending += 1
    return (found[0], found[1], tuple(t.shape), t.stride(), t.storage_offset())


def _unpack(obj: Any) -> torch.Tensor:
    if isinstance(obj, torch.Tensor):
        return obj
    recipe, i, shape, stride, offset = obj
    _STATS["regathered"] += 1
    return recipe.unpack(i).as_strided(shape, stride, offset)   # same layout as the storage gathered in forward


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
    """Counters (for tests): saved tensors replaced by recipes (``packed``), unpacked again
    (``regathered``), and the collectives those unpacks issued (``gathers``)."""
    return dict(_STATS)
