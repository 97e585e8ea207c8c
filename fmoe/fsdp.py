"""FSDP: data-parallel splits of the weights, gathered for compute, in one place.

A plan's tensor and expert parallelism (``tp``, ``ep``) split a weight for good: layer
functions compute on their slice and run their own collectives. The data-parallel axes
(``fsdp`` for dense weights, ``efsdp`` for experts, and ``dp_replicate`` if a plan splits over
it) only split the *storage*: a layer computes with the weight gathered over them. Everything
about those splits lives here:

- **the plan** (:func:`data_parallel_plan`, :func:`add_data_axis`): the model plan plus one
  ``fsdp`` / ``efsdp`` split per leaf, so no rank stores a full copy;
- **one weight** (:func:`unshard`, the old ``fmoe.materialize``): this rank's compute tensor,
  every data-parallel split all-gathered for the call; the gather's backward is a
  reduce-scatter (the sum over the gathering ranks, each keeps its slice);
- **one layer** (:func:`unshard_layer`, :func:`unsharded_layers`, the old ``prefetch``):
  every FSDP-split leaf of a layer's subtree gathered together, ONE all-gather per process group
  and dtype, and in backward ONE reduce-scatter of all their gradients. The result is the same
  tree whose gathered leaves are DTensors replicated over the data-parallel axis (the split is
  part of the value's placement, not of a hidden registry), so :func:`unshard` on them has
  nothing left to gather. Model files iterate ``for layer in unsharded_layers(params["layers"])``;
- **re-gathering in backward** (:func:`regather_in_backward`): autograd would keep every
  layer's gathered weights alive until backward. Inside the context, a saved tensor that is (a
  view of) a gathered weight is replaced by a recipe (its local shards and process group) and
  gathered again when backward unpacks it. Each gathered tensor carries its recipe; the
  counters belong to the context (:class:`RegatherCounts`), not to the module.

Dividing gradients by the number of batches (the per-batch mean) is the trainer's business
(:mod:`fmoe.train.grads`). The module holds no mutable state.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from . import tree as _tree
from .collectives import all_gather, all_gather_rows, group_size, reduce_scatter_rows
from .mesh import Mesh
from .placement import P, chunk_range, chunk_sizes
from .plan import Plan
from .sharding import placed_like, placement_of, to_local
from .transforms import active as transforms_active
from .transforms import peel

__all__ = ["KEEP", "unshard", "unshard_layer", "unsharded_layers", "regather_in_backward", "RegatherCounts",
           "gather_flat", "add_data_axis", "data_parallel_plan"]

KEEP = ("tp", "ep")          # axes a layer keeps split (it runs its own collectives for them)
_RECIPE = "_fmoe_regather"   # attribute of a gathered tensor: (recipe, index) to gather it again


# ---------------------------------------------------------------------------- the plan
def add_data_axis(p: P, shape: tuple, mesh: Mesh) -> P:
    """``p`` with ``fsdp`` (dense) or ``efsdp`` (experts) added on the first free divisible dim,
    else on the first free dim with at least that many entries (an uneven split, ``torch.chunk``
    sizes, as DTensor's ``Shard``).

    A leaf with no such dim (a scalar, or shorter than the axis) stays replicated; its gradient
    is all-reduced by :func:`fmoe.train.grads.reduce_grads`.

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


# ---------------------------------------------------------------------------- one weight
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
    def setup_context(ctx, inputs, output):
        ctx.group, ctx.dims = inputs[0], inputs[1]
        leaves = inputs[3:]
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
            elif isinstance(g, DTensor):
                g = g._local_tensor
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


# ---------------------------------------------------------------------------- re-gathering in backward
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
