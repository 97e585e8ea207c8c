"""Apply a plan: every rank keeps its slice of each parameter, as a DTensor.

``shard(params, plan, mesh)`` resolves and validates the whole plan first (so a bad plan
raises on every rank before anything is sliced or sent), then cuts each rank's slice out of the
full tensor it already holds (same seed everywhere, or a checkpoint) and wraps it as a DTensor
over the dense or the expert ``DeviceMesh``. No communication happens.

Why DTensors: gradients come back with the same placements, elementwise optimizer math stays
local, a global norm is a DTensor reduction, and ``torch.distributed.checkpoint`` reshards them.
Hot paths never compute on DTensors: layer functions take ``to_local(t)`` (:mod:`fmoe.sharding.local`, or
``fmoe.fsdp.unshard(t)``, which also gathers data-parallel splits) and insert their own autograd
collectives, reading the placement with ``placement_of(t)``: the placement is stored once, in
the DTensor's spec.

``gather(tree)`` turns every DTensor back into a plain full tensor on every rank (parameters or
gradients; ``Partial`` gradients are summed): ``gather(shard(p, plan, mesh))`` equals ``p``
bitwise.

In a single process (or a one-rank world) ``shard`` validates and returns the leaves unchanged.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from .. import tree as _tree
from ..mesh import Mesh
from ..transforms import compiling, peel
from .placement import P, chunk_range
from .plan import Plan, local_shape

__all__ = ["shard", "gather", "placement_of", "sequence_parallel", "local_shard", "dtensor_placements", "slice_for_rank",
           "rank_blocks", "from_local_slice"]

#: The one layer option a DTensor spec cannot hold: ``P(..., gather=True)`` (a colwise layer
#: gathers its output). Set by :func:`from_local_slice` / :func:`placed_like`, read by
#: :func:`placement_of`; everything else about a placement is read from the DTensor's spec.
_GATHER_OUTPUT = "_fmoe_gather_output"
#: Sequence parallelism (``fmoe.Mesh(..., sp=True)``), a property of the mesh a leaf was placed
#: on that the layer functions need but a DTensor spec cannot hold: set on every leaf by
#: :func:`from_local_slice` when ``mesh.sp``, copied by :func:`placed_like`, read by
#: :func:`sequence_parallel`. The layer functions without a mesh argument (``fmoe.nn``) learn
#: sequence parallelism from it; ``fmoe.moe``, which takes the mesh, reads ``mesh.sp``.
_SEQUENCE_PARALLEL = "_fmoe_sequence_parallel"
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
        >>> from fmoe.mesh import RankLayout
        >>> rank_blocks((8, 4), P("tp", None, packed=2), RankLayout(2, rank=1, tp=2))   # tp rank 1 of 2
        ([(slice(2, 4, None), slice(0, 4, None)), (slice(6, 8, None), slice(0, 4, None))], 0)
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
    :func:`rank_blocks`).

    Example:
        >>> from fmoe.mesh import RankLayout
        >>> slice_for_rank(torch.arange(8), P("tp", packed=2), RankLayout(2, rank=1, tp=2)).tolist()
        [2, 3, 6, 7]
    """
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
        >>> from fmoe.mesh import RankLayout      # a slice of the wrong shape: refused before any wrapping
        >>> from_local_slice(torch.zeros(3, 4), (8, 4), P("tp", None), RankLayout(2, rank=1, tp=2))
        Traceback (most recent call last):
        ValueError: from_local_slice: local slice has shape (3, 4), but P('tp', None) of a tensor of shape (8, 4) gives this rank a slice of shape (4, 4)
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
    if mesh.sp:
        setattr(out, _SEQUENCE_PARALLEL, True)
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


def local_shard(t: Any) -> torch.Tensor:
    """This rank's storage of a leaf: a DTensor's local tensor, a plain tensor itself. No
    autograd edge (optimizer updates, checkpoint blocks, gradient buckets); compute that needs
    gradients takes :func:`fmoe.sharding.to_local` instead.

    Example:
        >>> local_shard(torch.ones(2))
        tensor([1., 1.])
    """
    return t._local_tensor if isinstance(t, DTensor) else t


def sequence_parallel(t: Any) -> bool:
    """Whether leaf ``t`` was placed on a sequence-parallel mesh (``fmoe.Mesh(tp=n, sp=True)``,
    n > 1): the layer functions that use it then take and return activations split over ``tp``
    on the sequence (the dim before the features; :mod:`fmoe.nn`). False for a plain tensor.

    Example:
        >>> sequence_parallel(torch.ones(2))
        False
    """
    return bool(getattr(peel(t), _SEQUENCE_PARALLEL, False))


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


