"""Data-parallel sharding of parameters: FSDP for dense weights, efsdp for experts, HSDP.

A model's plan says how tensor and expert parallelism split each parameter. For training,
:func:`data_parallel_plan` adds one more split per leaf so no rank stores a full copy:

- a dense leaf (no expert axis) gets ``"fsdp"`` on its first dim that is not split yet and is
  divisible by the fsdp size (else on its first free dim with at least fsdp entries, split
  unevenly with ``torch.chunk`` sizes); it stays replicated over ``dp_replicate`` (HSDP);
- an expert leaf (split over ``"ep"``) gets ``"efsdp"`` the same way;
- a leaf with no such dim (a small norm weight or bias) stays replicated; its gradient is
  all-reduced by :func:`fmoe.train.grads.reduce_grads`.

Layer functions gather these splits for the call (``fmoe.materialize``: all-gather forward,
reduce-scatter backward). Inside :func:`regather_in_backward` the gathered full weights are not
kept alive for the backward pass: autograd saves a recipe (the local shard) instead and gathers
again when the backward needs the weight.
"""

from __future__ import annotations

from typing import Any

from .. import tree as _tree
from ..mesh import Mesh
from ..placement import P
from ..plan import Plan
from ..regather import regather_in_backward

__all__ = ["data_parallel_plan", "add_data_axis", "regather_in_backward"]


def add_data_axis(p: P, shape: tuple, mesh: Mesh) -> P:
    """``p`` with ``fsdp`` (dense) or ``efsdp`` (experts) added on the first free divisible dim.

    Example:
        >>> import types
        >>> m = types.SimpleNamespace(fsdp=2, efsdp=1, size=lambda a: {"tp": 2, "fsdp": 2}.get(a, 1))
        >>> add_data_axis(P("tp", None), (8, 6), m)
        P('tp', 'fsdp')
    """
    expert = bool({"ep", "efsdp"} & set(p.mesh_axes()))
    axis = "efsdp" if expert else "fsdp"
    n = mesh.efsdp if expert else mesh.fsdp
    if n == 1 or axis in p.mesh_axes():
        return p
    entries = list(p.axes) + [None] * (len(shape) - len(p.axes))
    free = [d for d, size in enumerate(shape) if entries[d] is None and size >= n]
    even = [d for d in free if shape[d] % n == 0]
    if not free:
        return p
    entries[(even or free)[0]] = axis          # no divisible dim: an uneven split (torch.chunk sizes)
    return P(*entries, packed=p.packed, gather=p.gather)


def data_parallel_plan(model_plan: Plan, params: Any, mesh: Mesh) -> Plan:
    """The model plan with data-parallel splits added (one exact-path rule per leaf).

    Args:
        model_plan: the model's TP/EP plan (``model.plan(cfg)`` or a user override).
        params: parameter tree (full tensors or anything with ``.shape``).
        mesh: the training mesh.
    Returns:
        a strict :class:`Plan` covering every leaf.
    """
    resolved = _tree.flatten(model_plan.resolve(params, mesh))
    shapes = {k: tuple(v.shape) for k, v in _tree.flatten(params).items()}
    rules = [(path, add_data_axis(p, shapes[path], mesh)) for path, p in resolved.items()]
    return Plan(rules)
