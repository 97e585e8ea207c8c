"""Differentiable slice collectives: ``all_gather`` / ``gather_slices`` (concatenate the ranks'
slices, uneven ones too), ``reduce_scatter`` (sum, keep the own slice) and ``local_slice`` (keep
the own slice of a replicated input), as new-style ``torch.autograd.Function``s whose backward is
the adjoint exchange (the table in :mod:`fmoe.collectives`). The vmap rules move the batch dim
first and gather once for the whole batch. ``gathered_linear`` is ``all_gather`` fused with the
linear layer that consumes it (a sequence-parallel colwise layer): it keeps this rank's slice for
backward, not the gathered tensor, and gathers it again there.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..transforms import apply, without_jvp
from .buffers import all_gather_rows, all_gather_sizes, group_size
from .counting import count

__all__ = ["all_gather", "gather_slices", "reduce_scatter", "local_slice", "gathered_linear"]


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
    count("reduce_scatter", padded, n)
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


class _GatheredLinear(torch.autograd.Function):
    """``y = all_gather(x) @ w.T + b`` saving ``x`` (this rank's slice), not the gathered input:
    backward gathers ``x`` again for ``dw`` and reduce-scatters ``dx`` (the adjoint of the gather:
    each rank's ``dx`` is partial, from its own output features). Backward is made of
    differentiable pieces, so higher derivatives work."""

    @staticmethod
    def forward(x, w, b, dim, sizes, group):
        return F.linear(_gather(x, dim, sizes, group), w, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, b, ctx.dim, ctx.sizes, ctx.group = inputs
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)
        ctx.has_bias = b is not None

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _ReduceScatter.apply(g.matmul(w), ctx.dim, ctx.sizes, ctx.group)     # [..., S / n, in]
        if ctx.needs_input_grad[1]:
            xf = _AllGather.apply(x, ctx.dim, ctx.sizes, ctx.group, False)           # [..., S, in] again
            dw = g.reshape(-1, g.shape[-1]).t().matmul(xf.reshape(-1, xf.shape[-1]))  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g.reshape(-1, g.shape[-1]).sum(0)
        return dx, dw, db, None, None, None

    @staticmethod
    def jvp(ctx, dx, dw, db, *_):
        x, w = ctx.saved_tensors
        out = None
        for t in (None if dx is None else F.linear(_gather(dx, ctx.dim, ctx.sizes, ctx.group), w),
                  None if dw is None else F.linear(_gather(x, ctx.dim, ctx.sizes, ctx.group), dw), db):
            if t is not None:
                out = t if out is None else out + t
        return out

    @staticmethod
    def vmap(info, in_dims, x, w, b, dim, sizes, group):
        if in_dims[1] is None and in_dims[2] is None:   # one gather for the whole batch of inputs
            if in_dims[0] is None:
                return _GatheredLinear.apply(x, w, b, dim, sizes, group), None
            xb, d = _batch_first(x, in_dims[0], dim)
            return _GatheredLinear.apply(xb, w, b, d, sizes, group), 0
        outs = [_GatheredLinear.apply(*[t if d is None else t.select(d, i) for t, d in zip((x, w, b), in_dims[:3])],
                                      dim, sizes, group) for i in range(info.batch_size)]
        return torch.stack(outs), 0                     # per-example weights: one call per example


_GatheredLinearTraced = without_jvp(_GatheredLinear)


def gathered_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], group: Optional[dist.ProcessGroup],
                    dim: int = 0) -> torch.Tensor:
    """``F.linear(all_gather(x, group, dim), w, b)`` with every rank's slice of ``dim`` equal,
    keeping only ``x`` for backward (the gathered input is gathered again there): a
    sequence-parallel colwise layer (:func:`fmoe.nn.linear`). Backward: ``dx`` reduce-scattered,
    ``dw`` and ``db`` from the whole gathered input.

    Args:
        x: this rank's slice ``[..., in]`` (``dim`` not the last).
        w: ``[out, in]``; b: ``[out]`` or None.
        group: process group (None: single process, a plain ``F.linear``).
        dim: the gathered dim.
    Returns:
        ``[..., out]`` with ``dim`` ``group size`` times longer.

    Example:
        >>> gathered_linear(torch.ones(2, 3), torch.ones(4, 3), None, None).shape
        torch.Size([2, 4])
    """
    if group_size(group) == 1:
        return F.linear(x, w, b)
    return apply(_GatheredLinear, _GatheredLinearTraced, x, w, b, dim, [x.shape[dim]] * group_size(group), group)
