"""Data-parallel gradient reduction: from per-rank gradients to the per-batch mean.

After each rank calls ``backward()`` on the mean loss of its own batch:

- a leaf split over ``fsdp`` / ``efsdp`` already holds the SUM over the copies that gathered it
  (``fmoe.materialize``'s backward is a reduce-scatter);
- an expert already holds the sum over the ``ep / tp`` distinct batches of its EP group
  (the dispatch's backward);
- a leaf *replicated* over a data-parallel axis (``fsdp``, ``dp_replicate``, ``efsdp``) holds
  only its own batches' gradient: it is all-reduced (summed) over that axis here;
- a ``Partial`` placement (e.g. a q/k-norm weight used on tp-sharded heads) is summed over its
  axis here;
- a leaf replicated over ``tp`` or ``ep`` already holds the full gradient of its batch on every
  rank of the group (TP ranks compute identical values): nothing to do.

Every leaf then holds the sum over all ``dp_replicate * fsdp`` batches, and dividing by that
number gives the per-batch mean — the gradient of the mean loss over the union of the batches,
i.e. exactly the single-process gradient of the whole global batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate

from .. import tree as _tree
from ..mesh import Mesh
from .optim import _like

__all__ = ["reduce_grads", "DATA_AXES"]

DATA_AXES = ("fsdp", "dp_replicate", "efsdp")


def _reduce_leaf(g: Any, p: Any, num_batches: int) -> Any:
    if g is None:
        raise ValueError("reduce_grads: a parameter has no gradient (not used in the loss?)")
    if not isinstance(g, DTensor):
        return g / num_batches
    local = g._local_tensor.clone()
    mesh = g.device_mesh
    for i, (name, pl) in enumerate(zip(mesh.mesh_dim_names, g.placements)):
        if mesh.mesh.shape[i] == 1:
            continue
        if isinstance(pl, Partial) or (isinstance(pl, Replicate) and name in DATA_AXES):
            dist.all_reduce(local, group=mesh.get_group(name))
    local = local / num_batches
    return _like(local, p)


def reduce_grads(grads: Any, params: Any, mesh: Mesh) -> Any:
    """Sum gradients over the data-parallel copies that do not hold them yet, divide by the
    number of batches; returns a tree placed like ``params``.

    Args:
        grads: per-rank gradients (``p.grad`` of every leaf), same structure as ``params``.
        params: the parameters (their placements are the result's placements).
        mesh: the job's :class:`fmoe.Mesh`.
    Returns:
        reduced gradients.
    """
    n = mesh.num_batches
    with torch.no_grad():
        return _tree.map_with_path(lambda _, g, p: _reduce_leaf(g, p, n), grads, params)
