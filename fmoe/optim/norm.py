"""The global gradient norm: every element counted once across the world, whatever the mesh.

A shard replicated on ``n`` ranks contributes ``local_sq / n`` on each of them and one
all-reduce over the world sums the result. (Counting expert shards once per efsdp copy, or
TP-replicated norms once per TP rank, is the classic MoE grad-norm bug.) The square sum is kept
apart from the all-reduce (:func:`local_square_sum`, :func:`norm_of`) so a step that sees its
gradients one layer at a time (:mod:`fmoe.training.optim_backward`) sums the shares as they come
and reduces once.

Example:
    >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).item()
    5.0
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import tree as _tree
from ..collectives import sum_over_world
from ..precision import upcast
from ..sharding import local_shard

__all__ = ["global_norm", "local_square_sum", "norm_of", "clip_scale"]


def _replicas(t: Any) -> int:
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for size, pl in zip(t.device_mesh.shape, t.placements):
        if isinstance(pl, Replicate):
            n *= size
    return n


def _square_sum(t: torch.Tensor, row: int = 1024) -> torch.Tensor:
    """``sum(t ** 2)`` in float64: dot products of ``row``-element rows in at least fp32 (one BLAS
    pass, no temporary of ``t``'s size), summed in float64; ~1e-10 relative (an fp32 elementwise
    square-and-sum is 6x slower and ~1e-7; torch's fp32 ``norm`` kernel is off by ~1e-4)."""
    f = upcast(t).reshape(-1)
    n = f.numel() // row * row
    rows = f[:n].view(-1, 1, row)
    return torch.bmm(rows, rows.transpose(1, 2)).sum(dtype=torch.float64) + f[n:].double().square().sum()


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all leaves together, each element counted once across the world.

    Args:
        tree: gradients (DTensors or plain tensors); Partial placements must be reduced first.
    Returns:
        a scalar, equal on every rank: float32, or float64 when a leaf is float64.

    Example:
        >>> global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).item()
        5.0
    """
    leaves = _tree.leaves(tree)
    return norm_of(local_square_sum(leaves), leaves)


def local_square_sum(leaves: Sequence[Any]) -> torch.Tensor:
    """This rank's share of the squared global norm of ``leaves`` (float64): each local shard's
    square sum divided by its number of replicas, so summing the shares over the world counts
    every element once (:func:`global_norm` is the square root of that sum)."""
    total = torch.zeros((), dtype=torch.float64)
    for leaf in leaves:
        total = total + _square_sum(local_shard(leaf)) / _replicas(leaf)
    return total


def norm_of(square_sum: torch.Tensor, leaves: Sequence[Any]) -> torch.Tensor:
    """The global norm from this rank's :func:`local_square_sum` share (one all-reduce over the
    world): float32, or float64 when a leaf of ``leaves`` is float64."""
    out = torch.float64 if any(x.dtype == torch.float64 for x in leaves) else torch.float32
    return sum_over_world(square_sum).sqrt().to(out)


def clip_scale(norm: torch.Tensor, cfg: Any) -> torch.Tensor:
    """The factor the gradients are multiplied by: ``min(1, max_grad_norm / (norm + 1e-6))``, 1
    without clipping."""
    if cfg.max_grad_norm is None:
        return torch.ones((), dtype=norm.dtype)
    return torch.clamp(cfg.max_grad_norm / (norm + 1e-6), max=1.0)
