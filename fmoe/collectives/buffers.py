"""Collectives autograd never sees: buffers and bookkeeping (split sizes, statistics, metrics,
gradient buckets, objects), each a plain call of ``torch.distributed`` that is a no-op (or a
copy) when the group is None or has one rank.

``all_gather_rows``, ``reduce_scatter_rows``, ``all_to_all_rows`` move one equal row per rank;
``all_gather_sizes`` and ``all_reduce_coalesced`` (one flat all-reduce per dtype) serve the
dispatch and the gradient reduction; ``broadcast_from`` a group's tensor; ``sum_over_world``,
``barrier``, ``broadcast_object`` and ``all_gather_objects`` work on the default group.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from .counting import count

__all__ = ["group_size", "all_gather_sizes", "all_reduce_coalesced", "all_gather_rows", "reduce_scatter_rows",
           "all_to_all_rows", "sum_over_world", "barrier", "broadcast_object", "broadcast_from", "all_gather_objects"]


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    """Number of ranks in ``group`` (1 for None)."""
    return 1 if group is None else dist.get_world_size(group)


def all_gather_sizes(n: int, group: Optional[dist.ProcessGroup]) -> list[int]:
    """Every rank's ``n`` (one small all-gather)."""
    if group_size(group) == 1:
        return [n]
    t = torch.tensor([n], dtype=torch.int64)
    out = [torch.empty_like(t) for _ in range(group_size(group))]
    count("all_gather", t, group_size(group))
    dist.all_gather(out, t, group=group)
    return [int(o.item()) for o in out]


def all_gather_rows(xm: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Every rank's equal-sized ``xm`` (contiguous, split on dim 0) concatenated on dim 0 in rank
    order: one collective, not differentiable (torch's ``all_gather_single``, or its older
    name ``all_gather_into_tensor``)."""
    out = xm.new_empty((xm.shape[0] * group_size(group),) + tuple(xm.shape[1:]))
    count("all_gather", xm, group_size(group))
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
    count("reduce_scatter", send, group_size(group))
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
    count("all_to_all", send, group_size(group))
    dist.all_to_all_single(recv, send, group=group)
    return recv


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def sum_over_world(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over every rank of the default group, in place (no-op in one process); returns
    ``x``. Not differentiable: metrics and norms."""
    if _world_size() > 1:
        count("all_reduce", x, _world_size())
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
        if dist.get_rank(group) == group_src:
            count("broadcast", x, group_size(group))
        dist.broadcast(x, group=group, group_src=group_src)
    return x


def all_gather_objects(obj: object) -> list:
    """Every rank's ``obj`` (picklable), in rank order, on every rank of the default group.
    Under the fake process group (the dry run: no bytes move, and a pickled object cannot ride
    in a fake tensor) every rank's object is this rank's."""
    if _world_size() == 1:
        return [obj]
    if dist.get_backend() == "fake":
        return [obj] * _world_size()
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
            count("all_reduce", flat, group_size(group))
            dist.all_reduce(flat, group=group)
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out  # type: ignore[return-value]
