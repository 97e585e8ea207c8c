"""Differentiable collectives: ``torch.autograd.Function``s over torch.distributed.

Each function is a new-style autograd Function (``forward`` + ``setup_context``), so it works
under ``torch.autograd`` and ``torch.func.grad`` alike. Every collective is linear, so its
``jvp`` is the same exchange applied to the tangent; its vmap rule moves the batch dim out of
the way of the exchanged dim (next to the rows for ``all_to_all``, first otherwise) and runs
the collective once for the whole batch. Every one takes a process group and is a
no-op when the group is None or has one rank (single process).

=================  =========================  ==========================================
function           forward                    backward
=================  =========================  ==========================================
all_to_all         rows to ranks by splits    the reverse exchange
all_reduce         sum over the group         identity (grads of a replicated output)
grad_sum           identity                   sum over the group
all_gather         concat slices (uneven ok)  reduce-scatter: sum, keep own slice
gather_slices      concat slices (uneven ok)  keep own slice (output used identically)
reduce_scatter     sum, keep own slice        all-gather
local_slice        keep own slice             all-gather of the slices' gradients
=================  =========================  ==========================================

Not differentiable (bookkeeping and buffers that autograd never sees): ``all_gather_rows``,
``reduce_scatter_rows``, ``all_to_all_rows`` (one equal row per rank, e.g. split sizes),
``all_gather_sizes``, ``all_reduce_coalesced``, ``broadcast_from``, and the world-level
``sum_over_world``, ``barrier``, ``broadcast_object`` and ``all_gather_objects``.

This module is the only one in the package that calls ``torch.distributed`` collectives
(``tests/unit/test_architecture.py`` checks it); process-group bookkeeping (``get_rank``,
``get_world_size``, ``new_group``) may live elsewhere.

``all_gather`` is the exact adjoint for a gathered tensor that each rank uses in a *different*
loss; ``gather_slices`` is for the usual tensor-parallel case where every rank of the group
computes the *same* loss on the replicated result (summing would multiply gradients by the
group size). ``local_slice`` is for a replicated input of which each rank of the group processes
a disjoint slice (token dispatch with ``tp > 1``): its gradient lives on the slice only, so
gathering the slices gives every rank the full gradient at half the bytes of ``grad_sum``'s
all-reduce.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .transforms import apply, compiling, without_jvp

__all__ = ["all_to_all", "all_reduce", "grad_sum", "all_gather", "gather_slices",
           "reduce_scatter", "local_slice", "group_size", "all_gather_sizes", "all_reduce_coalesced",
           "all_gather_rows", "reduce_scatter_rows", "all_to_all_rows", "sum_over_world", "barrier",
           "broadcast_object", "broadcast_from", "all_gather_objects"]


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def _exchange(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x, list(out_splits), list(in_splits), group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(x, out_splits, in_splits, group):
        return _exchange(x, out_splits, in_splits, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.out_splits, ctx.in_splits, ctx.group = inputs

    @staticmethod
    def backward(ctx, g):
        return _AllToAll.apply(g, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        return _exchange(dx, ctx.out_splits, ctx.in_splits, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, out_splits, in_splits, group):    # batch next to the rows: [N, B, ...]
        if in_dims[0] is None:
            return _AllToAll.apply(x, out_splits, in_splits, group), None
        return _AllToAll.apply(x.movedim(in_dims[0], 1), out_splits, in_splits, group), 1


_AllToAllTraced = without_jvp(_AllToAll)


def all_to_all(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int],
               group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Send ``x``'s rows to the ranks of ``group``: ``in_splits[r]`` rows go to rank r,
    ``out_splits[r]`` rows arrive from rank r (empty splits allowed). Backward: the reverse.

    Args:
        x: ``[sum(in_splits), ...]``.
        out_splits: rows received from each rank.
        in_splits: rows sent to each rank.
        group: process group (None: single process, requires equal splits).
    Returns:
        ``[sum(out_splits), ...]``.

    Example:
        >>> all_to_all(torch.ones(2, 3), [2], [2], None).shape
        torch.Size([2, 3])
    """
    if group_size(group) == 1:
        return x
    if compiling():      # torch's traceable all-to-all: split sizes may be symbolic (dynamic shapes)
        return funcol.all_to_all_single_autograd(x.contiguous(), list(out_splits), list(in_splits), group)
    if x.shape[0] != sum(in_splits):
        raise ValueError(f"all_to_all: x has {x.shape[0]} rows but in_splits sum to {sum(in_splits)}")
    return apply(_AllToAll, _AllToAllTraced, x, [int(s) for s in out_splits], [int(s) for s in in_splits], group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        out = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g, None

    @staticmethod
    def jvp(ctx, dx, _):
        return _AllReduce.forward(dx, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _AllReduce.apply(x, group), in_dims[0]


_AllReduceTraced = without_jvp(_AllReduce)


class _GradSum(torch.autograd.Function):
    @staticmethod
    def forward(x, group):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _AllReduce.apply(g, ctx.group), None

    @staticmethod
    def jvp(ctx, dx, _):
        return dx.view_as(dx)

    @staticmethod
    def vmap(info, in_dims, x, group):
        return _GradSum.apply(x, group), in_dims[0]


_GradSumTraced = without_jvp(_GradSum)


def all_reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Sum ``x`` over ``group``; backward passes the gradient through unchanged."""
    return x if group_size(group) == 1 else apply(_AllReduce, _AllReduceTraced, x, group)


def grad_sum(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Identity; backward sums the gradient over ``group`` (a replicated input feeding
    rank-partial computations, e.g. the input of a colwise linear)."""
    return x if group_size(group) == 1 else apply(_GradSum, _GradSumTraced, x, group)


def all_gather_sizes(n: int, group: Optional[dist.ProcessGroup]) -> list[int]:
    """Every rank's ``n`` (one small all-gather)."""
    if group_size(group) == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(group_size(group))]
    dist.all_gather(out, t, group=group)
    return [int(o.item()) for o in out]


def all_gather_rows(xm: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Every rank's equal-sized ``xm`` (contiguous, split on dim 0) concatenated on dim 0 in rank
    order: one collective, not differentiable (torch's ``all_gather_single``, or its older
    name ``all_gather_into_tensor``)."""
    out = xm.new_empty((xm.shape[0] * group_size(group),) + tuple(xm.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, xm, group=group)
    return out


def reduce_scatter_rows(send: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """``send [n, total]`` (row r for rank r of ``group``) summed over the ranks; this rank keeps
    its row ``[total]``: one reduce-scatter, not differentiable.

    Example:
        >>> reduce_scatter_rows(torch.ones(1, 3), None).tolist()
        [1.0, 1.0, 1.0]
    """
    if group_size(group) == 1:
        return send.reshape(-1).clone()
    out = send.new_empty(send.shape[1])
    dist.reduce_scatter_single(out, send.reshape(-1), group=group)
    return out


def all_to_all_rows(send: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Row r of ``send [n, ...]`` goes to rank r of ``group``; row r of the result came from rank
    r (one equal-split all-to-all, not differentiable: split sizes and statistics).

    Example:
        >>> all_to_all_rows(torch.tensor([3]), None).tolist()
        [3]
    """
    if group_size(group) == 1:
        return send.clone()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_world(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over every rank of the default group, in place (no-op in one process); returns
    ``x``. Not differentiable: metrics and norms."""
    if _world_size() > 1:
        dist.all_reduce(x)
    return x


def barrier() -> None:
    """Wait for every rank of the default group (no-op in one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_from(x: torch.Tensor, group: Optional[dist.ProcessGroup], group_src: int = 0) -> torch.Tensor:
    """``x`` of the rank with index ``group_src`` in ``group``, on every rank of it, in place
    (contiguous ``x``; no-op for one rank); returns ``x``. Not differentiable."""
    if group_size(group) > 1:
        dist.broadcast(x, group=group, group_src=group_src)
    return x


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of the default group."""
    if _world_size() == 1:
        return [obj]
    every: list = [None] * _world_size()
    dist.all_gather_object(every, obj)
    return every


def broadcast_object(obj: object, src: int = 0) -> object:
    """Rank ``src``'s ``obj`` (picklable) on every rank of the default group."""
    if _world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def _batch_first(x: torch.Tensor, bdim: int, dim: int) -> tuple[torch.Tensor, int]:
    """For a vmap rule: ``x`` with its batch dim ``bdim`` moved first, and the physical index of
    the per-example dim ``dim`` (negative dims count from the end of the per-example shape, so
    ``dim=-1`` never lands on the batch dim)."""
    return x.movedim(bdim, 0), dim % (x.ndim - 1) + 1


def _gather(x: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    xm = x.movedim(dim, 0).contiguous()
    m = max(sizes)
    if xm.shape[0] < m:
        pad = xm.new_zeros((m - xm.shape[0],) + tuple(xm.shape[1:]))
        xm = torch.cat([xm, pad])
    out = all_gather_rows(xm, group)
    if all(s == m for s in sizes):          # equal slices (FSDP, TP): no unpadding copy
        return out.movedim(0, dim)
    pieces = [out[i * m: i * m + s] for i, s in enumerate(sizes)]
    return torch.cat(pieces).movedim(0, dim)


def _own_slice(g: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    r = dist.get_rank(group)
    start = sum(sizes[:r])
    return g.narrow(dim, start, sizes[r]).contiguous()


def _reduce_own_slice(g: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Sum ``g`` over the group and keep this rank's slice: one reduce-scatter (half the bytes
    of an all-reduce); uneven slices are zero-padded to the largest."""
    gm = g.movedim(dim, 0)
    m, n = max(sizes), len(sizes)
    if all(s == m for s in sizes):
        padded = gm.contiguous()
    else:
        padded = gm.new_zeros((m * n,) + tuple(gm.shape[1:]))
        for i, piece in enumerate(gm.split(list(sizes))):
            padded[i * m: i * m + piece.shape[0]] = piece
    out = padded.new_empty((m,) + tuple(gm.shape[1:]))
    dist.reduce_scatter_single(out, padded, group=group)
    return out[:sizes[dist.get_rank(group)]].movedim(0, dim).contiguous()


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, sizes, group, replicated):
        return _gather(x, dim, sizes, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.sizes, ctx.group, ctx.replicated = inputs

    @staticmethod
    def backward(ctx, g):
        if ctx.replicated:
            return _own_slice(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None
        return _ReduceScatter.apply(g, ctx.dim, ctx.sizes, ctx.group), None, None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        return _gather(dx, ctx.dim, ctx.sizes, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, dim, sizes, group, replicated):
        if in_dims[0] is None:
            return _AllGather.apply(x, dim, sizes, group, replicated), None
        return _AllGather.apply(*_batch_first(x, in_dims[0], dim), sizes, group, replicated), 0


_AllGatherTraced = without_jvp(_AllGather)


def _sizes_for(x: torch.Tensor, dim: int, sizes: Optional[Sequence[int]], group) -> list[int]:
    if sizes is None:
        return all_gather_sizes(x.shape[dim], group)
    sizes = [int(s) for s in sizes]
    if len(sizes) != group_size(group) or sizes[dist.get_rank(group)] != x.shape[dim]:
        raise ValueError(f"all_gather: sizes {sizes} do not match the group or x.shape[{dim}]={x.shape[dim]}")
    return sizes


def all_gather(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 0,
               sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (uneven sizes allowed; pass ``sizes`` to
    skip the size exchange). Backward: sum over ranks, keep own slice (reduce-scatter)."""
    if group_size(group) == 1:
        return x
    return apply(_AllGather, _AllGatherTraced, x, dim, _sizes_for(x, dim, sizes, group), group, False)


def gather_slices(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 0,
                      sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Like :func:`all_gather`, for a result every rank uses identically: backward keeps this
    rank's slice of its own gradient, no sum."""
    if group_size(group) == 1:
        return x
    return apply(_AllGather, _AllGatherTraced, x, dim, _sizes_for(x, dim, sizes, group), group, True)


class _ReduceScatter(torch.autograd.Function):
    """Sum over the group, keep this rank's slice (``sizes`` per rank, uneven allowed); the
    adjoint of :class:`_AllGather`, and what its backward applies (a Function, so that
    ``torch.func`` sees a collective on plain tensors at every level)."""

    @staticmethod
    def forward(x, dim, sizes, group):
        return _reduce_own_slice(x, dim, sizes, group)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.sizes, ctx.group = inputs

    @staticmethod
    def backward(ctx, g):
        return _AllGather.apply(g, ctx.dim, ctx.sizes, ctx.group, True), None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        return _reduce_own_slice(dx, ctx.dim, ctx.sizes, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, dim, sizes, group):
        if in_dims[0] is None:
            return _ReduceScatter.apply(x, dim, sizes, group), None
        return _ReduceScatter.apply(*_batch_first(x, in_dims[0], dim), sizes, group), 0


_ReduceScatterTraced = without_jvp(_ReduceScatter)


def reduce_scatter(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's equal slice of ``dim``. Backward: all-gather."""
    if group_size(group) == 1:
        return x
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} is not divisible by group size {n}")
    return apply(_ReduceScatter, _ReduceScatterTraced, x, dim, [x.shape[dim] // n] * n, group)


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(x, dim, sizes, group):
        r = dist.get_rank(group)
        return x.narrow(dim, sum(sizes[:r]), sizes[r])

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.dim, ctx.sizes, ctx.group = inputs

    @staticmethod
    def backward(ctx, g):
        return _AllGather.apply(g, ctx.dim, ctx.sizes, ctx.group, True), None, None, None

    @staticmethod
    def jvp(ctx, dx, *_):
        return _LocalSlice.forward(dx, ctx.dim, ctx.sizes, ctx.group)

    @staticmethod
    def vmap(info, in_dims, x, dim, sizes, group):
        if in_dims[0] is None:
            return _LocalSlice.apply(x, dim, sizes, group), None
        return _LocalSlice.apply(*_batch_first(x, in_dims[0], dim), sizes, group), 0


_LocalSliceTraced = without_jvp(_LocalSlice)


def local_slice(x: torch.Tensor, group: Optional[dist.ProcessGroup], sizes: Sequence[int], dim: int = 0) -> torch.Tensor:
    """This rank's slice of a tensor replicated over ``group`` (``sizes[r]`` along ``dim`` for
    rank r, uneven or empty allowed). Backward: the slices' gradients all-gathered, so every
    rank gets the full gradient (each slice's gradient is nonzero on its own rows only).

    Args:
        x: the replicated tensor; ``x.shape[dim] == sum(sizes)``.
        group: process group (None: single process, returns ``x``).
        sizes: slice length per rank.
        dim: the split dimension.
    Returns:
        ``x.narrow(dim, sum(sizes[:rank]), sizes[rank])``.

    Example:
        >>> local_slice(torch.ones(4, 2), None, [4]).shape
        torch.Size([4, 2])
    """
    sizes = [int(s) for s in sizes]
    if x.shape[dim] != sum(sizes):
        raise ValueError(f"local_slice: x has {x.shape[dim]} entries on dim {dim} but sizes {sizes} sum to {sum(sizes)}")
    if group_size(group) == 1:
        return x
    if len(sizes) != group_size(group):
        raise ValueError(f"local_slice: sizes {sizes} must have one entry per rank of the group ({group_size(group)})")
    return apply(_LocalSlice, _LocalSliceTraced, x, dim, sizes, group)


def all_reduce_coalesced(tensors: Sequence[torch.Tensor], group: Optional[dist.ProcessGroup]) -> list[torch.Tensor]:
    """Sum every tensor over ``group`` with one all-reduce per dtype (a flat buffer), instead of
    one collective per tensor: for many small tensors (gradients of norms, biases, small
    layers) the per-call rendezvous dominates. Not differentiable; the inputs are not modified.

    Args:
        tensors: any shapes; mixed dtypes are bucketed by dtype.
        group: process group (None or one rank: copies of the inputs are returned).
    Returns:
        the summed tensors, in order, with the input shapes.

    Example:
        >>> [t.tolist() for t in all_reduce_coalesced([torch.ones(2), torch.zeros(1)], None)]
        [[1.0, 1.0], [0.0]]
    """
    out: list[Optional[torch.Tensor]] = [None] * len(tensors)
    buckets: dict = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.dtype, t.device), []).append(i)
    for idx in buckets.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        if group_size(group) > 1:
            dist.all_reduce(flat, group=group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]

