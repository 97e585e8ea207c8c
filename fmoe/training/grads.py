"""Data-parallel gradient reduction: from per-rank gradients to the per-batch mean.

After each rank calls ``backward()`` on the mean loss of its own batch, every gradient leaf is
a DTensor whose placements say honestly what it holds (:func:`fmoe.sharding.grad_placements`):

- ``Partial`` on every axis whose batches are not summed yet: a data-parallel axis (``fsdp``,
  ``dp_replicate``, ``efsdp``) over which the leaf is replicated (each rank holds its own
  batch's gradient), and ``tp`` for a q/k-norm weight used on tp-split heads;
- the leaf's own ``Shard`` where the sum is done: a leaf split over ``fsdp`` / ``efsdp``
  (``fmoe.fsdp.unshard``'s backward is a reduce-scatter), an expert over ``ep`` (the dispatch's
  backward sums its EP group's batches);
- ``Replicate`` over ``tp``/``ep`` where every rank computed the same full-batch value.

The reduction is the redistribution of those placements to the parameter's own: every
``Partial`` axis is all-reduced (one flat all-reduce per group of leaves that need the same
reductions). Every leaf then holds the sum over all ``dp_replicate * fsdp`` batches (what
``fmoe.gather`` of the raw gradients gives), and dividing by that number gives the per-batch
mean — the gradient of the mean loss over the union of the batches, i.e. exactly the
single-process gradient of the whole global batch.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial

from .. import tree as _tree
from ..collectives import all_reduce_coalesced
from ..mesh import DATA_AXES, Mesh
from ..sharding import local_shard
from ..sharding import placed_like as _like

__all__ = ["accumulate", "reduce_grads", "reduce_flat", "DATA_AXES"]

def _axes_to_reduce(g: Any) -> tuple:
    """Mesh axes over which this gradient still has to be summed (in mesh-dim order)."""
    if g is None:
        raise ValueError("reduce_grads: a parameter has no gradient (not used in the loss?)")
    if not isinstance(g, DTensor):
        return ()
    mesh = g.device_mesh
    return tuple((mesh.mesh_dim_names, name) for i, (name, pl) in enumerate(zip(mesh.mesh_dim_names, g.placements))
                 if mesh.shape[i] > 1 and isinstance(pl, Partial))


def reduce_grads(grads: Any, params: Any, mesh: Mesh, inplace: bool = False) -> Any:
    """Sum gradients over the data-parallel copies that do not hold them yet, divide by the
    number of batches; returns a tree placed like ``params`` (:func:`reduce_flat` on the
    flattened trees).

    Args:
        grads: per-rank gradients (``p.grad`` of every leaf), same structure as ``params``.
        params: the parameters (their placements are the result's placements).
        mesh: the job's :class:`fmoe.Mesh`.
        inplace: as in :func:`reduce_flat`.
    Returns:
        reduced gradients.

    Example:
        >>> from fmoe import Mesh
        >>> reduce_grads({"w": torch.ones(2)}, {"w": torch.zeros(2)}, Mesh())
        {'w': tensor([1., 1.])}
    """
    out = reduce_flat(_tree.flatten(grads), _tree.flatten(params), mesh, inplace=inplace)
    return _tree.unflatten(out, like=grads)


def accumulate(acc: Optional[list], grads: Sequence[torch.Tensor]) -> list:
    """The micro-batches' gradients summed: ``grads`` themselves for the first (``acc`` None),
    else added to ``acc`` in place on the local shards (the train step and a pipeline stage).

    Example:
        >>> accumulate(accumulate(None, [torch.ones(2)]), [torch.ones(2)])
        [tensor([2., 2.])]
    """
    if acc is None:
        return list(grads)
    for a, g in zip(acc, grads):
        local_shard(a).add_(local_shard(g))
    return acc


def reduce_flat(flat_g: dict, flat_p: dict, mesh: Mesh, inplace: bool = False) -> dict:
    """:func:`reduce_grads` on flat ``{path: leaf}`` dicts, as the train step holds them (no
    tree walk): sum over the data-parallel copies that do not hold a gradient yet, divide by the
    number of batches.

    Leaves that need the same reductions share one flat all-reduce per axis
    (:func:`fmoe.collectives.all_reduce_coalesced`): one collective per group, not per leaf.

    Args:
        flat_g: per-rank gradients by path.
        flat_p: the parameters by path (at least ``flat_g``'s paths; their placements are the
            result's placements).
        mesh: the job's :class:`fmoe.Mesh`.
        inplace: divide the given gradients in place instead of copying them (for gradients
            nothing else reads, e.g. fresh from ``torch.autograd.grad``): saves one full-size
            copy of every leaf that needs no reduction, such as the experts.
    Returns:
        the reduced gradients by path, in ``flat_g``'s order.

    Example:
        >>> from fmoe import Mesh
        >>> reduce_flat({"a.w": torch.ones(2)}, {"a.w": torch.zeros(2)}, Mesh())
        {'a.w': tensor([1., 1.])}
    """
    if not isinstance(inplace, bool):
        raise TypeError(f"reduce_grads: inplace must be a bool, got {type(inplace).__name__}")
    n = mesh.num_batches
    with torch.no_grad():
        local = {k: local_shard(g) for k, g in flat_g.items()}
        plans: dict[tuple, list[str]] = {}                 # reductions still due -> leaves
        owned: set[str] = set()                            # leaves now held in a reduction buffer
        for k, g in flat_g.items():
            plans.setdefault(_axes_to_reduce(g), []).append(k)
        for axes in sorted(plans, key=repr):               # the same order on every rank
            keys = plans[axes]
            for _, name in axes:
                group = flat_g[keys[0]].device_mesh.get_group(name)
                for k, t in zip(keys, all_reduce_coalesced([local[k] for k in keys], group)):
                    local[k] = t
                    owned.add(k)
        # fresh reduction buffers are divided in place; the caller's own ones only if inplace
        return {k: _like(local[k] if n == 1 else local[k].div_(n) if inplace or k in owned else local[k] / n,
                         flat_p[k]) for k in flat_g}
