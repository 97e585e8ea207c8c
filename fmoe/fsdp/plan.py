"""The data-parallel plan: the model's TP/EP plan plus one ``fsdp`` / ``efsdp`` split per leaf.

A plan's ``tp`` and ``ep`` split a weight for good; the data-parallel axes only split its
storage, so every rank stores a slice and the layer gathers the rest for the call
(:mod:`fmoe.fsdp.gather`). :func:`add_data_axis` picks the dim of one leaf that takes the
split (dense leaves ``fsdp``, expert leaves ``efsdp``; HSDP replicates over ``dp_replicate``),
:func:`data_parallel_plan` does it for every leaf of a parameter tree.
"""

from __future__ import annotations

from typing import Any

from .. import tree as _tree
from ..mesh import Mesh
from ..sharding import P, Plan

__all__ = ["add_data_axis", "data_parallel_plan"]


def add_data_axis(p: P, shape: tuple, mesh: Mesh) -> P:
    """``p`` with ``fsdp`` (dense) or ``efsdp`` (experts) added on the first free divisible dim,
    else on the first free dim with at least that many entries (an uneven split, ``torch.chunk``
    sizes, as DTensor's ``Shard``).

    A leaf with no such dim (a scalar, or shorter than the axis) stays replicated; its gradient
    is all-reduced by :func:`fmoe.training.grads.reduce_grads`.

    Example:
        >>> import types
        >>> m = types.SimpleNamespace(fsdp=2, efsdp=1, size=lambda a: {"tp": 2, "fsdp": 2}.get(a, 1))
        >>> add_data_axis(P("tp", None), (8, 6), m)
        P('tp', 'fsdp')
    """
    expert = bool({"ep", "efsdp"} & set(p.mesh_axes()))
    axis = "efsdp" if expert else "fsdp"
    n = mesh.efsdp if expert else mesh.size("fsdp")       # with cp: data shards x cp ranks
    if n == 1 or axis in p.mesh_axes():
        return p
    entries = list(p.axes) + [None] * (len(shape) - len(p.axes))
    free = [d for d, size in enumerate(shape) if entries[d] is None and size >= n]
    if not free:
        return p
    even = [d for d in free if shape[d] % n == 0]
    entries[(even or free)[0]] = axis
    return P(*entries, packed=p.packed, gather=p.gather)


def data_parallel_plan(model_plan: Plan, params: Any, mesh: Mesh) -> Plan:
    """The model plan with data-parallel splits added (one exact-path rule per leaf): dense
    leaves get ``fsdp`` (replicated over ``dp_replicate``: HSDP), expert leaves ``efsdp``.

    Args:
        model_plan: the model's TP/EP plan (``model.plan(cfg)`` or a user override).
        params: parameter tree (full tensors or anything with ``.shape``).
        mesh: the training mesh.
    Returns:
        a strict :class:`Plan` covering every leaf.
    """
    resolved = _tree.flatten(model_plan.resolve(params, mesh))
    shapes = {k: tuple(v.shape) for k, v in _tree.flatten(params).items()}
    return Plan([(path, add_data_axis(p, shapes[path], mesh)) for path, p in resolved.items()])
