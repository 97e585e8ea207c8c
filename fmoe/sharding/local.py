"""A sharded leaf's local slice, and new local tensors placed like a leaf.

Layer functions compute on local slices: :func:`to_local` hands a DTensor's slice to compute
(differentiable; its backward wraps the local gradient with the honest placements of
:func:`grad_placements`, ``Partial`` on every data-parallel axis the leaf is replicated over, so
``fmoe.gather`` sums what each batch contributed). It also refuses, before any collective, the
transform nestings a sharded leaf cannot serve (two derivative levels, a vmap-stacked leaf, a
batch of jvp tangents: :mod:`fmoe.sharding.dtensor_rules`).

The other direction: :func:`placed_like` wraps a new local tensor (an optimizer update, a
gathered weight, a bias update) with a leaf's placement, and :func:`local_part` cuts this
rank's part of a whole tensor as a leaf is placed. Neither communicates.

Importing this module installs DTensor's missing forward-mode rule
(:func:`fmoe.sharding.dtensor_rules.install`), so ``torch.func.jvp`` runs over sharded trees.
"""

from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch._C._functorch import _wrap_for_grad, get_unwrapped, is_functorch_wrapped_tensor, maybe_get_level
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from ..mesh import DATA_AXES
from ..transforms import apply, compiling, peel, without_jvp
from .dtensor_rules import BATCHED_TANGENTS, NESTED, batched, check_levels
from .dtensor_rules import install as _install_dtensor_rules
from .shard import _GATHER_OUTPUT, _PACKED, _SEQUENCE_PARALLEL

_install_dtensor_rules()          # forward mode (jvp / jacfwd) over DTensor trees

__all__ = ["to_local", "grad_placements", "placed_like", "local_part"]


def local_part(full: torch.Tensor, like: Any) -> torch.Tensor:
    """This rank's part of ``full`` (the same whole tensor on every rank), cut as ``like`` (a
    DTensor of ``full``'s shape) is placed; nothing is communicated.

    Example:
        >>> local_part(torch.ones(3), torch.zeros(3)).shape
        torch.Size([3])
    """
    if not isinstance(like, DTensor):
        return full
    replicated = [Replicate()] * like.device_mesh.ndim
    t = DTensor.from_local(full, like.device_mesh, replicated, run_check=False)
    return t.redistribute(like.device_mesh, like.placements).to_local()


def placed_like(local: torch.Tensor, ref: Any, spec: Optional[DTensorSpec] = None) -> Any:
    """``local`` (a new local tensor: an optimizer update, a gathered weight) placed like
    ``ref``: a DTensor with ``ref``'s spec (or ``spec``, e.g. ``ref``'s placements with an axis
    gathered) and ``ref``'s layer option; ``local`` itself when ``ref`` is a plain tensor.
    Nothing is communicated; a ``local`` that requires grad keeps its autograd history
    (``DTensor.from_local``), any other is wrapped directly (25x cheaper).

    Args:
        local: this rank's tensor.
        ref: the DTensor (or tensor) whose placement to take.
        spec: the spec to use instead of ``ref``'s own.
    Returns:
        a DTensor (or ``local``).

    Example:
        >>> placed_like(torch.zeros(2), torch.ones(2)).shape
        torch.Size([2])
    """
    if not isinstance(ref, DTensor):
        return local
    mine = ref._local_tensor
    if spec is not None:
        out = DTensor(local, spec, requires_grad=False)
    elif (not local.requires_grad and local.dtype == ref.dtype and local.shape == mine.shape
          and local.stride() == mine.stride()):
        out = DTensor(local, ref._spec, requires_grad=False)    # same spec: skips from_local's checks (25x)
    else:
        out = DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False,
                                 shape=ref.shape, stride=ref.stride())
    for attr in (_GATHER_OUTPUT, _PACKED, _SEQUENCE_PARALLEL):
        if getattr(ref, attr, None):
            setattr(out, attr, getattr(ref, attr))
    return out


def to_local(t: Any, partial_grad: Sequence[str] = ()) -> torch.Tensor:
    """The local slice of a leaf for compute (identity for plain tensors); differentiable.

    Args:
        t: DTensor or tensor.
        partial_grad: mesh axes over which this rank's gradient is a partial sum (e.g. ``("tp",)``
            for a replicated per-head norm weight used on head-sharded activations); the DTensor
            gradient is then marked ``Partial`` there and summed lazily (e.g. by :func:`gather`).
    Returns:
        a plain tensor.
    """
    d = peel(t)
    if not isinstance(d, DTensor):
        return t
    grad_pl = grad_placements(d, partial_grad)
    if not compiling():
        check_levels(t)
    if compiling():                  # DTensor's own to_local: Dynamo traces it (and its backward)
        return t.to_local(grad_placements=grad_pl)
    return apply(_ToLocal, _ToLocalTraced, t, grad_pl)


def grad_placements(t: DTensor, partial_grad: Sequence[str] = ()) -> tuple:
    """The honest placements of the gradient of ``t``'s local slice: ``Partial`` (a sum still
    pending) on every data-parallel axis (``fsdp``, ``efsdp``, ``dp_replicate``, size > 1)
    over which ``t`` is replicated, since each rank's gradient holds its own batch only, and on
    the ``partial_grad`` axes; ``t``'s own placement elsewhere (a split axis: the slice's
    gradient; ``tp``/``ep`` replicated: every rank computes the same full-batch value).
    ``fmoe.gather`` then sums the pending parts: the gradient of the sum over the batches."""
    mesh = t.device_mesh
    out = []
    for i, (name, pl) in enumerate(zip(mesh.mesh_dim_names, t.placements)):
        pending = name in partial_grad or (name in DATA_AXES and mesh.shape[i] > 1)
        out.append(Partial() if pending and isinstance(pl, Replicate) else Replicate() if isinstance(pl, Partial) else pl)
    return tuple(out)


class _ToLocal(torch.autograd.Function):
    """``DTensor.to_local`` whose backward wraps the local gradient with a prepared spec
    (``DTensor(g, spec)``) instead of ``DTensor.from_local``: one per leaf and step, ~25x cheaper."""

    @staticmethod
    def forward(t, grad_placements):
        return t._local_tensor.view_as(t._local_tensor)

    @staticmethod
    def setup_context(ctx, inputs, output):
        t, grad_placements = inputs
        t = peel(t)
        ctx.set_materialize_grads(False)
        local = t._local_tensor
        ctx.spec, ctx.grad_placements, ctx.stride = t._spec, grad_placements, local.stride()
        ctx.contiguous = local.is_contiguous()

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None
        level = None
        if is_functorch_wrapped_tensor(g):   # torch.func.grad / vjp: wrap the plain gradient as the
            level = maybe_get_level(g)       # DTensor, then re-enter the level, so that what the
            g = get_unwrapped(g)             # transform returns is a DTensor of real storage
            if is_functorch_wrapped_tensor(g):
                raise NotImplementedError(NESTED)
        out = _grad_dtensor(ctx, g)
        return (out if level is None else _wrap_for_grad(out, level)), None

    @staticmethod
    def jvp(ctx, dt, _):                           # linear: the tangent's local slice
        if batched(dt):                           # jacfwd: vmap-batched tangents
            raise NotImplementedError(BATCHED_TANGENTS)
        d = peel(dt)
        return d._local_tensor.view_as(d._local_tensor) if isinstance(d, DTensor) else dt.view_as(dt)

    @staticmethod
    def vmap(info, in_dims, t, grad_placements):   # a batched DTensor: its local slice, batched alike
        return _ToLocal.apply(t, grad_placements), in_dims[0]


def _grad_dtensor(ctx, g: torch.Tensor) -> DTensor:
    """The local gradient ``g`` wrapped with the prepared spec (``DTensor(g, spec)``: ~25x
    cheaper than ``DTensor.from_local``)."""
    spec = ctx.spec
    if g.stride() != ctx.stride and ctx.contiguous:
        g = g.contiguous()
    if g.stride() != ctx.stride:         # an unusual layout: let torch compute the global stride
        return DTensor.from_local(g, spec.mesh, ctx.grad_placements, run_check=False)
    grad_spec = (copy.copy(spec) if ctx.grad_placements == spec.placements else
                 DTensorSpec(spec.mesh, ctx.grad_placements, tensor_meta=spec.tensor_meta))
    return DTensor(g, grad_spec, requires_grad=False)


_ToLocalTraced = without_jvp(_ToLocal)

