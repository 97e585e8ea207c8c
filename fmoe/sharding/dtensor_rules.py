"""Sharded (DTensor) trees under ``torch.func``: the DTensor rule torch lacks for forward mode,
and the refusals for the nestings a sharded leaf cannot serve.

``torch.func.jvp(f, (params,), (tangents,))`` starts by pairing each primal with its tangent
(``make_dual``), which asks ``aten._has_same_storage_numel(primal, tangent)``. DTensor has no
sharding rule for that query, so forward mode (``jvp``, ``jacfwd``, forward-over-reverse HVPs)
over a tree of DTensor leaves failed before the function ran. The answer does not depend on
the sharding: two DTensors of the same spec have the same storage size exactly when their
local slices do, so the rule below asks the local slices. Everything after that pairing already
works, because fmoe's layers never compute on DTensors: :func:`fmoe.sharding.to_local` hands
the local slice of the primal to the layer and the local slice of the tangent to its ``jvp``.

The rule is installed once, on import of :mod:`fmoe.sharding.local` (see :func:`install`).

What cannot work is refused where a layer first reads a sharded leaf (:func:`check_levels`,
called by :func:`fmoe.sharding.to_local`), before any collective, with an error that says what
to use instead: two derivative levels around a leaf (:data:`NESTED`), a leaf batched by
``vmap`` (:data:`STACKED`), a batch of ``jvp`` tangents (:data:`BATCHED_TANGENTS`).

Example:
    >>> install()        # idempotent
    >>> torch.ops.aten._has_same_storage_numel.default in DTensor._op_dispatcher._custom_op_handlers
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C._functorch import get_unwrapped, is_batchedtensor, is_functorch_wrapped_tensor
from torch.distributed.tensor import DTensor

from .shard import local_shard

__all__ = ["install", "check_levels", "batched", "NESTED", "STACKED", "BATCHED_TANGENTS"]

_aten = torch.ops.aten


def _same_storage_numel(op: Any, args: tuple, kwargs: dict) -> bool:
    """``aten._has_same_storage_numel`` on DTensors: the same question asked of the local slices."""
    a, b = args
    return _aten._has_same_storage_numel.default(local_shard(a), local_shard(b))


def install() -> None:
    """Register the rules above with DTensor's dispatcher (idempotent).

    Returns:
        None.
    """
    handlers = DTensor._op_dispatcher._custom_op_handlers
    handlers.setdefault(_aten._has_same_storage_numel.default, _same_storage_numel)


NESTED = ("a gradient of sharded (DTensor) parameters inside another torch.func transform "
          "(grad of grad, vmap of grad, jvp of grad: e.g. a forward-over-reverse HVP) is not supported on a "
          "mesh: the DTensor cannot carry the outer transform's wrapper. Instead take the outer derivative "
          "with torch.autograd.grad(..., create_graph=True), loop over examples in Python, or use plain "
          "(unsharded) parameters on one process")
STACKED = ("torch.func.vmap over stacked sharded (DTensor) parameter trees (an ensemble) is not supported "
           "on a mesh: a layer reads each parameter's placement, which a stacked DTensor shifts by the "
           "stacked dim. Instead loop over the members (fmoe.shard each tree), or vmap stacked plain trees "
           "on one process; vmap over the inputs with unstacked parameters works on a mesh")

BATCHED_TANGENTS = ("torch.func.jacfwd (or vmap over torch.func.jvp tangents) of sharded (DTensor) parameters "
                    "is not supported on a mesh: the layers' collectives have no batching rule for a batch of "
                    "tangents. Instead loop torch.func.jvp over the tangent directions in Python (jvp works on "
                    "a mesh), use torch.func.vjp / grad (reverse mode), or jacfwd on one process")


def _levels(t: Any) -> tuple[int, bool]:
    """``(functorch wrapper levels around t, whether one of them is a vmap batch)``."""
    levels, in_batch = 0, False
    while isinstance(t, torch.Tensor) and is_functorch_wrapped_tensor(t):
        levels, in_batch, t = levels + 1, in_batch or is_batchedtensor(t), get_unwrapped(t)
    return levels, in_batch


def batched(t: Any) -> bool:
    """Whether a ``vmap`` batch level wraps ``t`` (a batch of tangents under ``jacfwd``).

    Args:
        t: a tensor, possibly wrapped by ``torch.func`` levels.
    Returns:
        True when one of its levels is a vmap batch.

    Example:
        >>> batched(torch.ones(2)), torch.func.vmap(lambda x: torch.tensor(batched(x)))(torch.ones(2)).tolist()
        (False, [True, True])
    """
    return _levels(t)[1]


def check_levels(t: Any) -> None:
    """Refuse, before any collective, the transform nestings a sharded leaf cannot serve: the
    leaf batched by ``vmap`` (stacked trees), or wrapped by two derivative levels.

    Args:
        t: a sharded parameter as a layer receives it (DTensor, possibly wrapped).
    Returns:
        None; raises ``NotImplementedError`` (:data:`STACKED` or :data:`NESTED`).

    Example:
        >>> check_levels(torch.ones(2))      # no transform: nothing to refuse
    """
    levels, in_batch = _levels(t)
    if in_batch:
        raise NotImplementedError(STACKED)
    if levels >= 2:
        raise NotImplementedError(NESTED)
