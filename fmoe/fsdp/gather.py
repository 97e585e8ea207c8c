"""Gathering FSDP-split weights for compute: one weight, or a whole layer in one collective.

- **one weight** (:func:`unshard`): this rank's compute tensor,
  every data-parallel split all-gathered for the call; the gather's backward is a
  reduce-scatter (the sum over the gathering ranks, each keeps its slice);
- **compute copies** (:func:`cast_shards`): every floating leaf's *local shard* cast to the
  compute dtype once (a trainer does it once per step), placements kept, so the gathers that
  follow move bf16, half the bytes, and no layer casts a weight per call; the cast's backward
  returns each gradient in the master's dtype;
- **one layer** (:func:`unshard_layer`, :func:`unsharded_layers`, the old ``prefetch``):
  every FSDP-split leaf of a layer's subtree gathered together, ONE all-gather per process group
  and dtype (:class:`_GatherLayer`), and in backward ONE reduce-scatter of all their gradients.
  The result is the same tree whose gathered leaves are DTensors replicated over the
  data-parallel axis (the split is part of the value's placement, not of a hidden registry), so
  :func:`unshard` on them has nothing left to gather.

Every gathered tensor of equal pieces carries the recipe that gathers it again
(:func:`fmoe.fsdp.regather._remember`), so :func:`fmoe.fsdp.regather_in_backward` can drop it
after forward.
"""

from __future__ import annotations

import copy
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from .. import tree as _tree
from ..collectives import all_gather, group_size, reduce_scatter_rows
from ..sharding import chunk_range, chunk_sizes, local_shard, placed_like, placement_of, to_local
from ..transforms import peel
from .regather import _remember, gather_flat

__all__ = ["KEEP", "unshard", "unshard_layer", "unsharded_layers", "cast_shards"]

KEEP = ("tp", "ep")          # axes a layer keeps split (it runs its own collectives for them)


def unshard(t: Any, keep: Sequence[str] = KEEP, partial_grad: Sequence[str] = ()) -> torch.Tensor:
    """The tensor a layer computes with: this rank's slice along the ``keep`` axes, every other
    split axis (``fsdp``, ``efsdp``, ``dp_replicate``) all-gathered for the call.

    The gather's backward is a reduce-scatter (sum over the gathering ranks, keep own slice):
    the gradient of an FSDP-split weight is the sum of its data-parallel copies' gradients.

    Args:
        t: DTensor or plain tensor.
        keep: axes whose split stays local (layers handle them with their own collectives).
        partial_grad: passed to :func:`fmoe.sharding.to_local` (axes where the gradient is a
            partial sum).
    Returns:
        a plain tensor.

    Example:
        >>> unshard(torch.ones(2)).shape
        torch.Size([2])
    """
    if not isinstance(peel(t), DTensor):      # (under torch.func the DTensor is wrapped)
        return t
    p = placement_of(t)
    out = to_local(t, partial_grad)
    for d in p.sharded_dims():
        axes = p.dim_axes(d)
        gathered = [a for a in axes if a not in keep]
        if not gathered:
            continue
        if len(gathered) != len(axes) or d == p.packed_dim:
            raise ValueError(f"unshard: placement {p!r} mixes kept axes {list(keep)} and "
                             f"gathered axes {gathered} on dim {d} (or is packed); not supported")
        levels = [t.shape[d]]         # the dim's size before each nested split (torch.chunk pieces)
        for a in axes[:-1]:
            levels.append(chunk_range(levels[-1], group_size(peel(t).device_mesh.get_group(a)),
                                      peel(t).device_mesh.get_local_rank(a))[1])
        for a, size in zip(reversed(axes), reversed(levels)):      # innermost split first
            group = peel(t).device_mesh.get_group(a)
            piece = out
            sizes = chunk_sizes(size, group_size(group))
            out = all_gather(piece, group, dim=d, sizes=sizes)
            if len(set(sizes)) == 1:  # equal pieces: regather_in_backward may drop it and gather again
                _remember([out], [piece], group, [d])
    return out


# ---------------------------------------------------------------------------- one layer
def _gather_axis(t: DTensor) -> Optional[tuple[int, str]]:
    """``(dim, axis)`` when :func:`unshard` would gather ``t`` over exactly one axis on one
    (unpacked, unmixed) dim; None otherwise (left to :func:`unshard`, weight by weight)."""
    p = placement_of(t)
    found = []
    for d in p.sharded_dims():
        axes = p.dim_axes(d)
        gathered = [a for a in axes if a not in KEEP]
        if gathered:
            if len(axes) != 1 or d == p.packed_dim:
                return None
            found.append((d, gathered[0]))
    return found[0] if len(found) == 1 else None


def _replicated_over(spec: DTensorSpec, axis: str) -> DTensorSpec:
    """``spec`` with mesh axis ``axis`` replicated (same global shape)."""
    pls = tuple(Replicate() if name == axis else pl for name, pl in zip(spec.mesh.mesh_dim_names, spec.placements))
    return DTensorSpec(spec.mesh, pls, tensor_meta=spec.tensor_meta)


class _GatherLayer(torch.autograd.Function):
    """DTensors split over one data-parallel axis -> the same DTensors replicated over it, all
    in one all-gather; backward: one reduce-scatter of all their gradients."""

    @staticmethod
    def forward(group, dims, specs, *leaves):
        locals_ = [t._local_tensor for t in leaves]
        fulls = gather_flat(locals_, dims, group)
        _remember(fulls, locals_, group, dims)                  # lets regather_in_backward drop them
        return tuple(placed_like(f, t, spec=s) for f, s, t in zip(fulls, specs, leaves))

    @staticmethod
    def vmap(info, in_dims, group, dims, specs, *leaves):   # vmap over activations: weights unbatched
        if any(d is not None for d in in_dims[3:]):
            raise NotImplementedError("torch.func.vmap over stacked FSDP-split parameters is not supported; "
                                      "vmap over the inputs, or stack plain (unsharded) parameter trees")
        return _GatherLayer.apply(group, dims, specs, *leaves), (None,) * len(leaves)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.dims = inputs[0], inputs[1]
        leaves = [peel(t) for t in inputs[3:]]          # (wrapped when a transform is active)
        ctx.specs = [t._spec for t in leaves]
        ctx.shapes = [t._local_tensor.shape for t in leaves]
        ctx.dtype, ctx.device = leaves[0].dtype, leaves[0]._local_tensor.device
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads):
        n = group_size(ctx.group)
        rows = []
        for g, d, shape in zip(grads, ctx.dims, ctx.shapes):
            if g is None:                  # a weight the layer did not use
                full = list(shape)
                full[d] *= n
                g = torch.zeros(full, dtype=ctx.dtype, device=ctx.device)
            else:
                g = local_shard(g)
            pieces = torch.stack(g.split(shape[d], dim=d))                           # [n, *local]
            rows.append(pieces.reshape(n, -1))
        out = reduce_scatter_rows(torch.cat(rows, dim=1), ctx.group)                 # [total]
        sizes = [int(torch.Size(s).numel()) for s in ctx.shapes]
        return (None, None, None) + tuple(_grad_like(o.view(s), g, spec)
                                          for o, s, g, spec in zip(out.split(sizes), ctx.shapes, grads, ctx.specs))


def _grad_like(local: torch.Tensor, g: Any, spec: DTensorSpec) -> DTensor:
    """The leaf's gradient: its own placements, ``Partial`` where the gathered value's gradient
    was marked partial (e.g. a q/k-norm weight used on tp-split heads)."""
    marked = g.placements if isinstance(g, DTensor) else spec.placements
    grad_pls = tuple(m if isinstance(m, Partial) and isinstance(pl, Replicate) else pl   # the gathered axis: summed
                     for pl, m in zip(spec.placements, marked))
    grad_spec = copy.copy(spec) if grad_pls == spec.placements else \
        DTensorSpec(spec.mesh, grad_pls, tensor_meta=spec.tensor_meta)
    return DTensor(local, grad_spec, requires_grad=False)


def unshard_layer(params: Any) -> Any:
    """The same tree with every FSDP-split leaf gathered, one collective per process group and
    dtype: the gathered leaves are DTensors replicated over their data-parallel axis, so the
    layer functions (:func:`unshard`) use them as they are. Leaves with nothing to gather pass
    through (the tree itself is returned when there is none).

    Args:
        params: a subtree of parameters (e.g. one layer's dict), DTensors or plain tensors.
    Returns:
        the tree with gathered leaves.

    Example:
        >>> unshard_layer({"w": torch.ones(2)})["w"].shape       # plain tensors: nothing to gather
        torch.Size([2])
    """
    flat = _tree.flatten(params)
    todo: dict[tuple, list] = {}
    for path, leaf in flat.items():
        if isinstance(leaf, DTensor):
            found = _gather_axis(leaf)
            if found is not None:
                group = leaf.device_mesh.get_group(found[1])
                if group_size(group) > 1 and leaf.shape[found[0]] % group_size(group) == 0:  # uneven: unshard
                    todo.setdefault((id(group), leaf.dtype), []).append((path, leaf, found, group))
    if not todo:
        return params
    for members in todo.values():
        group = members[0][3]
        dims = [d for _, _, (d, _), _ in members]
        specs = [_replicated_over(leaf._spec, axis) for _, leaf, (_, axis), _ in members]
        fulls = _GatherLayer.apply(group, dims, specs, *[leaf for _, leaf, _, _ in members])
        for (path, leaf, _, _), full in zip(members, fulls):
            flat[path] = full
    return _tree.unflatten(flat, like=params)


def unsharded_layers(layers: Iterable[Any]) -> Iterator[Any]:
    """Each layer subtree through :func:`unshard_layer`, one at a time (gathered when the loop
    body needs it, not all up front).

    Example:
        >>> [len(layer) for layer in unsharded_layers([{"w": torch.ones(1)}])]
        [1]
    """
    for layer in layers:
        yield unshard_layer(layer)


# ---------------------------------------------------------------------------- compute copies
def _spec_as(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    """``spec`` with its tensor dtype changed (same mesh, placements, global shape)."""
    meta = spec.tensor_meta
    return DTensorSpec(spec.mesh, spec.placements, tensor_meta=TensorMeta(meta.shape, meta.stride, dtype))


def _cast_like(t: Any, dtype: torch.dtype) -> Any:
    """``t`` (DTensor or tensor) in ``dtype``: its local tensor cast, its placements kept."""
    if isinstance(t, DTensor):
        return placed_like(t._local_tensor.to(dtype), t, spec=_spec_as(t._spec, dtype))
    return t.to(dtype)


class _CastShard(torch.autograd.Function):
    """A leaf's local shard cast to ``dtype``, placed like the leaf (nothing communicated);
    backward: the gradient cast back to the leaf's dtype, with the gradient's own placements
    (``Partial`` stays ``Partial``)."""

    @staticmethod
    def forward(t, dtype):
        return _cast_like(t, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.dtype, ctx.out_dtype = inputs[0].dtype, inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, g):
        return (None if g is None else _cast_like(g, ctx.dtype)), None

    @staticmethod
    def jvp(ctx, dt, _):
        return _cast_like(dt, ctx.out_dtype)

    @staticmethod
    def vmap(info, in_dims, t, dtype):
        return _CastShard.apply(t, dtype), in_dims[0]


def cast_shards(params: Any, dtype: torch.dtype, skip: Sequence[str] = ()) -> Any:
    """The compute copy of a tree: every floating-point leaf's local shard cast to ``dtype``,
    placed like the leaf; differentiable (gradients arrive in each leaf's own dtype).

    Cast once per step, before the forward: FSDP-split leaves are then gathered in ``dtype``
    (:func:`unshard_layer`, :func:`unshard`: half the bytes of fp32 for bf16) and their
    reduce-scatter in backward moves ``dtype`` too; the cast's backward returns the reduced
    shard's gradient in the master dtype, so everything after (the trainer's reductions,
    clipping, the optimizer) stays in it.

    Args:
        params: a tree of DTensors or tensors (e.g. fp32 master weights that require grad).
        dtype: the compute dtype (e.g. ``torch.bfloat16``).
        skip: path globs of leaves kept as they are (e.g. ``("**.expert_bias",)``: a routing
            bias added to fp32 scores).
    Returns:
        the same tree; leaves already in ``dtype``, non-floating or skipped are the leaves themselves.

    Example:
        >>> w = torch.ones(2, 3, requires_grad=True)
        >>> c = cast_shards({"w": w, "b": torch.zeros(3)}, torch.bfloat16, skip=("b",))
        >>> c["w"].dtype, c["b"].dtype
        (torch.bfloat16, torch.float32)
        >>> c["w"].sum().backward(); w.grad.dtype
        torch.float32
    """
    def cast(path: str, t: Any) -> Any:
        if not t.dtype.is_floating_point or t.dtype == dtype or any(_tree.glob_match(g, path) for g in skip):
            return t
        return _CastShard.apply(t, dtype) if t.requires_grad and torch.is_grad_enabled() else _cast_like(t, dtype)
    return _tree.map_with_path(cast, params)
