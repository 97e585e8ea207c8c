"""FSDP: data-parallel splits of the weights, gathered for compute, in one place.

A plan's tensor and expert parallelism (``tp``, ``ep``) split a weight for good: layer
functions compute on their slice and run their own collectives. The data-parallel axes
(``fsdp`` for dense weights, ``efsdp`` for experts, and ``dp_replicate`` if a plan splits over
it) only split the *storage*: a layer computes with the weight gathered over them. Everything
about those splits lives in this package, one job per module:

- **the plan** (:mod:`fmoe.fsdp.plan`: :func:`data_parallel_plan`, :func:`add_data_axis`): the
  model plan plus one ``fsdp`` / ``efsdp`` split per leaf, so no rank stores a full copy;
- **gathering** (:mod:`fmoe.fsdp.gather`): one weight (:func:`unshard`: every data-parallel
  split all-gathered for the call, its backward a reduce-scatter) or one layer
  (:func:`unshard_layer`, :func:`unsharded_layers`: every FSDP-split leaf of a layer's subtree
  in ONE all-gather per process group and dtype, and in backward ONE reduce-scatter of all their gradients). Gathered leaves are
  DTensors replicated over the data-parallel axis (the split is part of the value's placement,
  not of a hidden registry). Model files iterate ``for layer in unsharded_layers(params["layers"])``;
- **re-gathering in backward** (:mod:`fmoe.fsdp.regather`: :func:`regather_in_backward`,
  :class:`RegatherCounts`): autograd would keep every layer's gathered weights alive until
  backward. Inside the context, a saved tensor that is (a view of) a gathered weight is replaced
  by a recipe (its local shards and process group) and gathered again when backward unpacks it.
  Each gathered tensor carries its recipe; the counters belong to the context, not to the module.

Import path: ``plan`` and ``regather`` import nothing of the package; ``gather`` imports
``regather`` (a gathered tensor records its recipe). Dividing gradients by the number of
batches (the per-batch mean) is the trainer's business (:mod:`fmoe.training.grads`). The package
holds no mutable state.

Example:
    >>> import torch
    >>> unshard(torch.ones(2)).shape                 # a plain tensor: nothing to gather
    torch.Size([2])
"""

from __future__ import annotations

from .gather import KEEP, _GatherLayer, cast_shards, unshard, unshard_layer, unsharded_layers  # noqa: F401  (_GatherLayer: for tests)
from .plan import add_data_axis, data_parallel_plan
from .regather import _RECIPE, RegatherCounts, _root, gather_flat, regather_in_backward  # noqa: F401  (_RECIPE, _root: for tests)

__all__ = ["KEEP", "cast_shards", "unshard", "unshard_layer", "unsharded_layers", "regather_in_backward", "RegatherCounts",
           "gather_flat", "add_data_axis", "data_parallel_plan"]

# _GatherLayer, _RECIPE and _root stay importable from here (tests and notes name them so).
