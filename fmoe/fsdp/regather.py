"""Re-gathering in backward: gathered FSDP weights saved as recipes instead of copies.

Autograd would keep every layer's gathered weights alive until backward. Inside
:func:`regather_in_backward`, a saved tensor that is (a view of) a gathered weight is replaced
by a recipe (its local shards and process group, :class:`_Recipe`) and gathered again, with
:func:`gather_flat`, when backward unpacks it. Each gathered tensor carries its recipe as an
attribute (set by :func:`_remember` when it is gathered); the counters belong to the context
(:class:`RegatherCounts`), not to the module.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

import torch

from ..collectives import all_gather_rows
from ..transforms import active as transforms_active

__all__ = ["regather_in_backward", "RegatherCounts", "gather_flat"]

_RECIPE = "_fmoe_regather"   # attribute of a gathered tensor: (recipe, index) to gather it again


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


@dataclass
class RegatherCounts:
    """What one :func:`regather_in_backward` context did: saved tensors replaced by recipes
    (``packed``), unpacked again (``regathered``), and the collectives those unpacks issued
    (``gathers``)."""

    packed: int = 0
    regathered: int = 0
    gathers: int = 0


class _Recipe:
    """Local shards of tensors gathered together (one collective): how to gather them again.
    The first unpack of any member re-gathers all of them (each in its forward memory layout,
    so saved views keep their strides); the copies live until every saved reference has been
    unpacked."""

    __slots__ = ("locals", "group", "dims", "layouts", "cache", "pending")

    def __init__(self, locals_: Sequence[torch.Tensor], group, dims: Sequence[int], fulls: Sequence[torch.Tensor]):
        self.locals, self.group, self.dims = [t.detach() for t in locals_], group, list(dims)
        self.layouts = [(f.stride(), f.storage_offset(), f.untyped_storage().nbytes() // f.element_size())
                        for f in fulls]
        self.cache: Optional[list] = None
        self.pending = 0

    def unpack(self, i: int, counts: RegatherCounts) -> torch.Tensor:
        if self.cache is None:
            counts.gathers += 1
            self.cache = gather_flat(self.locals, self.dims, self.group, like=self.layouts)
        out = self.cache[i]
        self.pending -= 1
        if self.pending <= 0:
            self.cache = None
        return out


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor owning ``t``'s storage (``t`` itself unless it is a view)."""
    return t if t._base is None else t._base


def _remember(fulls: Sequence[torch.Tensor], locals_: Sequence[torch.Tensor], group, dims: Sequence[int]) -> None:
    """Attach to each ``fulls[i]`` (``locals_[i]`` all-gathered over ``group`` along ``dims[i]``,
    all in one collective) the recipe that gathers it again. Not under torch.func transforms or
    compile (wrapped tensors have no storage): there the gathered copies are kept for backward."""
    if transforms_active():
        return
    recipe = _Recipe(locals_, group, dims, fulls)
    for i, full in enumerate(fulls):
        setattr(_root(full), _RECIPE, (recipe, i))


@contextlib.contextmanager
def regather_in_backward(counts: Optional[RegatherCounts] = None) -> Iterator[RegatherCounts]:
    """Context in which gathered FSDP weights are saved as recipes and re-gathered in backward.
    Every rank unpacks in the same order (identical graphs), so the extra collectives line up.

    Args:
        counts: where to count (a fresh :class:`RegatherCounts` if None).
    Yields:
        the counts.

    Example:
        >>> with regather_in_backward() as counts:
        ...     pass
        >>> counts.packed
        0
    """
    counts = RegatherCounts() if counts is None else counts

    def pack(t: torch.Tensor) -> Any:
        found = getattr(_root(t), _RECIPE, None) if t.numel() else None
        if found is None:
            return t
        counts.packed += 1
        found[0].pending += 1
        return (found[0], found[1], tuple(t.shape), t.stride(), t.storage_offset())

    def unpack(obj: Any) -> torch.Tensor:
        if isinstance(obj, torch.Tensor):
            return obj
        recipe, i, shape, stride, offset = obj
        counts.regathered += 1
        return recipe.unpack(i, counts).as_strided(shape, stride, offset)   # the layout gathered in forward

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield counts
