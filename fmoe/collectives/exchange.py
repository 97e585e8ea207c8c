"""Differentiable exchanges: ``all_to_all`` (rows to ranks by split sizes; backward the reverse
exchange), ``all_reduce`` (sum; backward identity) and ``grad_sum`` (identity; backward sum), as
new-style ``torch.autograd.Function``s (the table in :mod:`fmoe.collectives`). Each is linear, so
its ``jvp`` is the same exchange of the tangent; its vmap rule runs the collective once for the
whole batch.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..transforms import apply, compiling, without_jvp
from .buffers import group_size
from .counting import count, count_bytes

__all__ = ["all_to_all", "all_reduce", "grad_sum"]


def _exchange(x: torch.Tensor, out_splits: Sequence[int], in_splits: Sequence[int], group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
    count_bytes("all_to_all", (x.shape[0] - in_splits[dist.get_rank(group)]) * math.prod(x.shape[1:]) * x.element_size())
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
        count("all_reduce", out, group_size(group))
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
