"""Apply a plan: every rank keeps its slice of each parameter, as a DTensor.

``shard(params, plan, mesh)`` resolves and validates the whole plan first (so a bad plan
raises on every rank before anything is sliced or sent), then cuts each rank's slice out of the
full tensor it already holds (same seed everywhere, or a checkpoint) and wraps it as a DTensor
over the dense or the expert ``DeviceMesh``. No communication happens.

Why DTensors: gradients come back with the same placements, elementwise optimizer math stays
local, a global norm is a DTensor reduction, and ``torch.distributed.checkpoint`` reshards them.
Hot paths never compute on DTensors: layer functions take ``to_local(t)`` (or
``fmoe.fsdp.unshard(t)``, which also gathers data-parallel splits) and insert their own autograd
collectives, reading the placement with ``placement_of(t)``: the placement is stored once, in
the DTensor's spec.

``gather(tree)`` turns every DTensor back into a plain full tensor on every rank (parameters or
gradients; ``Partial`` gradients are summed): ``gather(shard(p, plan, mesh))`` equals ``p``
bitwise.

In a single process (or a one-rank world) ``shard`` validates and returns the leaves unchanged.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch._C._functorch import _wrap_for_grad, get_unwrapped, is_functorch_wrapped_tensor, maybe_get_level
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import _StridedShard

from . import tree as _tree
from .mesh import DATA_AXES, Mesh
from .placement import P, chunk_range
from .plan import Plan, local_shape

from .transforms import apply, compiling, peel, without_jvp
from .dtensor_rules import BATCHED_TANGENTS, NESTED, batched, check_levels
from .dtensor_rules import install as _install_dtensor_rules

_install_dtensor_rules()          # forward mode (jvp / jacfwd) over DTensor trees

__all__ = ["shard", "gather", "placement_of", "to_local", "grad_placements", "placed_like", "local_part",
           "dtensor_placements", "slice_for_rank", "rank_blocks", "from_local_slice"]

#: The one layer option a DTensor spec cannot hold: ``P(..., gather=True)`` (a colwise layer
#: gathers its output). Set by :func:`from_local_slice` / :func:`placed_like`, read by
#: :func:`placement_of`; everything else about a placement is read from the DTensor's spec.
_GATHER_OUTPUT = "_fmoe_gather_output"
#: A packed placement's part count, kept beside the spec's ``_StridedShard`` for
#: :func:`placement_of` under ``torch.compile``: Dynamo cannot read ``_StridedShard.split_factor``
#: (a C++ descriptor), so compiled code reads this attribute instead (eager reads the spec).
_PACKED = "_fmoe_packed"


def dtensor_placements(p: P, mesh: Mesh):
    """``(DeviceMesh, placements)`` that express ``p`` as a DTensor on ``mesh``."""
    axes = set(p.mesh_axes())
    dm = mesh.expert if axes & {"ep", "efsdp"} else mesh.dense
    placements = []
    for name in dm.mesh_dim_names:
        d = p.dim_of(name)
        if d is None:
            placements.append(Replicate())
        elif d == p.packed_dim:
            placements.append(_StridedShard(d, split_factor=p.packed))
        else:
            placements.append(Shard(d))
    return dm, placements


def rank_blocks(shape: tuple[int, ...], p: P, mesh: Mesh) -> tuple[list[tuple[slice, ...]], int]:
    """The index blocks that make this rank's slice of a tensor of ``shape`` under ``p``.

    Nested axes on one dim split in entry order (``P(("fsdp", "tp"))``: by fsdp first, then each
    piece by tp); a packed placement gives one block per packed part of its packed dim
    (``p.packed_dim``), to be concatenated along that dim. Checkpoint loading reads exactly
    these blocks; :func:`slice_for_rank` cuts them from a full tensor.

    Args:
        shape: the full shape.
        p: the placement (validated against ``mesh``).
        mesh: the mesh.
    Returns:
        ``(blocks, dim)``: index tuples and the dim to concatenate them along.

    Example:
        >>> # rank_blocks((8, 4), P("tp", None, packed=2), mesh)   # tp rank 1 of 2
        >>> # ([(slice(2, 4), slice(0, 4)), (slice(6, 8), slice(0, 4))], 0)
    """
    idx = [slice(0, n) for n in shape]
    packed = p.packed_dim
    for d in p.sharded_dims():
        if d == packed:
            continue
        start, n = 0, shape[d]
        for a in p.dim_axes(d):                       # torch.chunk pieces, nested in mesh order
            offset, n = chunk_range(n, mesh.size(a), mesh.rank_in(a))
            start += offset
        idx[d] = slice(start, start + n)
    if packed is None:
        return [tuple(idx)], 0
    (a,) = p.dim_axes(packed)                 # validated: the packed dim has one axis
    blk = shape[packed] // p.packed
    piece, r = blk // mesh.size(a), mesh.rank_in(a)
    return [tuple(idx[:packed] + [slice(b * blk + r * piece, b * blk + (r + 1) * piece)] + idx[packed + 1:])
            for b in range(p.packed)], packed


def slice_for_rank(full: torch.Tensor, p: P, mesh: Mesh) -> torch.Tensor:
    """This rank's slice of ``full`` under placement ``p`` (no communication; see
    :func:`rank_blocks`)."""
    blocks, d = rank_blocks(tuple(full.shape), p, mesh)
    return full[blocks[0]] if len(blocks) == 1 else torch.cat([full[b] for b in blocks], dim=d)


def from_local_slice(local: torch.Tensor, full_shape: Sequence[int], p: P, mesh: Mesh) -> DTensor:
    """Wrap this rank's already-cut slice of a tensor of ``full_shape`` as a DTensor placed by ``p``.

    ``local`` must be what :func:`slice_for_rank` would cut (e.g. read straight from a
    checkpoint); nothing is communicated. :func:`shard` uses it after slicing a full tensor.

    Args:
        local: this rank's slice (contiguous).
        full_shape: shape of the whole tensor.
        p: its placement.
        mesh: the :class:`Mesh` (with process groups).
    Returns:
        a DTensor whose :func:`placement_of` is ``p``.

    Example:
        >>> # w = from_local_slice(ck_block, (1024, 512), P("tp", None), mesh)
    """
    want = local_shape(tuple(full_shape), p, mesh)
    if tuple(local.shape) != want:
        raise ValueError(f"from_local_slice: local slice has shape {tuple(local.shape)}, but {p!r} of a "
                         f"tensor of shape {tuple(full_shape)} gives this rank a slice of shape {want}")
    dm, pls = dtensor_placements(p, mesh)
    out = DTensor.from_local(local, dm, pls, run_check=False, shape=torch.Size(full_shape),
                             stride=torch.empty(full_shape, device="meta").stride())
    if p.gather:
        setattr(out, _GATHER_OUTPUT, True)
    if p.packed > 1:
        setattr(out, _PACKED, p.packed)
    return out


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
    for attr in (_GATHER_OUTPUT, _PACKED):
        if getattr(ref, attr, None):
            setattr(out, attr, getattr(ref, attr))
    return out


def shard(params: Any, plan: Union[Plan, Mapping, Sequence], mesh: Optional[Mesh] = None) -> Any:
    """Place every leaf of ``params`` per ``plan``; each rank keeps only its slices.

    Args:
        params: parameter tree of full tensors (identical on every rank).
        plan: a :class:`Plan` (or rules for one).
        mesh: the :class:`Mesh`; None means a single process.
    Returns:
        the same tree with DTensor leaves (plain tensors when the world is one process).

    Example:
        >>> import torch, fmoe
        >>> p = {"w": torch.ones(4, 2)}
        >>> fmoe.shard(p, {"w": fmoe.P("tp", None)}, fmoe.Mesh())["w"].shape
        torch.Size([4, 2])
    """
    if not isinstance(plan, Plan):
        plan = Plan(plan)
    mesh = mesh if mesh is not None else Mesh()
    flat = _tree.flatten(params)
    for path, leaf in flat.items():
        if isinstance(leaf, DTensor):
            raise TypeError(f"shard: parameter {path!r} is already a DTensor; gather it first")
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"shard: parameter {path!r} must be a torch.Tensor, got {type(leaf).__name__}")
    placements = _tree.flatten(plan.resolve(params, mesh))
    if mesh.dense is None:
        return params

    def place(path: str, leaf: torch.Tensor) -> DTensor:
        p = placements[path]
        local = slice_for_rank(leaf.detach(), p, mesh).contiguous().clone()
        out = from_local_slice(local, leaf.shape, p, mesh)
        out.requires_grad_(leaf.requires_grad)
        return out

    return _tree.map_with_path(place, params)


def gather(tree: Any) -> Any:
    """Plain full tensors on every rank (DTensor leaves all-gathered, Partial ones summed).

    Call it on every rank with the same tree structure (it runs one collective per sharded leaf).

    Args:
        tree: parameters, gradients or any tree with DTensor / tensor leaves.
    Returns:
        the same tree with plain tensors.
    """

    def full(leaf: Any) -> Any:
        if isinstance(leaf, DTensor):
            return leaf.full_tensor()
        return leaf

    return _tree.map_with_path(lambda _, x: full(x), tree)


def placement_of(t: Any) -> P:
    """The :class:`P` of a leaf (``P()`` for a plain tensor), read from the DTensor's spec
    (``Shard`` / ``_StridedShard`` per mesh dim; nested axes in mesh order, as
    :meth:`P.validate` requires) plus the ``gather`` layer option (:func:`placed_like`).

    Example:
        >>> placement_of(torch.ones(2))
        P()
    """
    t = peel(t)                      # the DTensor under torch.func wrappers
    if not isinstance(t, DTensor):
        return P()
    entries: list = [None] * t.ndim
    packed = 1
    for name, pl in zip(t.device_mesh.mesh_dim_names, t.placements):
        if isinstance(pl, Shard) or isinstance(pl, _StridedShard):
            cur = entries[pl.dim]
            entries[pl.dim] = name if cur is None else (tuple(cur) if isinstance(cur, tuple) else (cur,)) + (name,)
            if isinstance(pl, _StridedShard):
                k = getattr(t, _PACKED, None) if compiling() else None
                k = pl.split_factor if k is None else k
                packed = k if k > 1 else packed
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries, packed=packed, gather=getattr(t, _GATHER_OUTPUT, False))


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

