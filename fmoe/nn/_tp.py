"""Helpers shared by the layer functions: which tensor-parallel group a parameter lives in
(public as :func:`fmoe.nn.axis_group` and :func:`fmoe.nn.tp_size_rank`, for layers a model
author writes), how to cut this rank's part out of a replicated activation, and the
sequence-parallel moves of an activation.

A parameter's process groups come from the parameter itself (a DTensor knows its DeviceMesh),
so layer functions never need a mesh argument: a plain tensor means "single process". So does
sequence parallelism: a leaf placed on a mesh with ``sp=True`` says so
(:func:`fmoe.sharding.sequence_parallel`), and the activation it meets is then split over
``tp`` on the sequence dim :data:`SEQ_DIM` (the dim before the features: ``S`` of
``[B, S, D]``, ``T`` of the tokens ``[T, D]`` an MoE layer takes), in equal pieces.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from einops import rearrange
from torch.distributed.tensor import DTensor

from ..collectives import group_size, local_slice, reduce_scatter
from ..sharding import chunk_range, sequence_parallel
from ..transforms import peel


def check_tensor(fn: str, name: str, t: object, ndim: Optional[int] = None) -> None:
    """Raise ``TypeError`` unless ``t`` is a tensor (with ``ndim`` dims when given)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.ndim != ndim:
        raise ValueError(f"{fn}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")


def axis_group(t: torch.Tensor, axis: str = "tp") -> Optional[dist.ProcessGroup]:
    """The process group of mesh axis ``axis`` that a parameter ``t`` lives on: a leaf of
    :func:`fmoe.shard` (a DTensor, also under ``torch.func``'s wrappers) on a mesh with that
    axis; None for a plain tensor (one process) or a mesh without the axis. A layer a model
    author writes asks its weight, never a mesh argument (as :func:`fmoe.nn.linear` does).

    Args:
        t: a parameter leaf (plain tensor or DTensor).
        axis: a mesh dim name: ``"tp"``, ``"fsdp"``, ``"dp_replicate"`` (dense mesh) or
            ``"ep"``, ``"efsdp"`` (expert mesh).
    Returns:
        the ``torch.distributed`` process group, or None.

    Example:
        >>> axis_group(torch.ones(4)) is None     # a plain tensor: single process
        True
    """
    t = peel(t)                      # the DTensor under torch.func's wrappers
    if isinstance(t, DTensor) and axis in (t.device_mesh.mesh_dim_names or ()):
        return t.device_mesh.get_group(axis)
    return None


def rank_of(group: Optional[dist.ProcessGroup]) -> int:
    """This rank's index in ``group`` (0 for None)."""
    return 0 if group is None else dist.get_rank(group)


def own_part(x: torch.Tensor, n: int, r: int, packed: int = 1) -> torch.Tensor:
    """Rank ``r``'s part of the last dim of ``x`` split ``n`` ways (``torch.chunk`` pieces), each
    of the ``packed`` blocks split separately (evenly): ``[g | u]`` -> ``[g_r | u_r]``.

    Example:
        >>> own_part(torch.arange(8), n=2, r=1, packed=2), own_part(torch.arange(5), n=2, r=1)
        (tensor([2, 3, 6, 7]), tensor([3, 4]))
    """
    if packed == 1:
        start, length = chunk_range(x.shape[-1], n, r)
        return x[..., start:start + length]
    parts = rearrange(x, "... (k n c) -> ... n (k c)", k=packed, n=n)
    return parts[..., r, :]


def unpack_gathered(y: torch.Tensor, n: int, packed: int) -> torch.Tensor:
    """Reorder a last dim gathered from ``n`` ranks that each held ``[g_r | u_r]`` into the
    full ``[g | u]`` layout (identity when ``packed == 1``)."""
    if packed == 1:
        return y
    return rearrange(y, "... (n k c) -> ... (k n c)", n=n, k=packed)


def tp_size_rank(t: torch.Tensor) -> tuple[Optional[dist.ProcessGroup], int, int]:
    """``(group, size, rank)`` of the tp group a parameter ``t`` lives on (:func:`axis_group`):
    what a layer needs to combine its local slice with the other tp ranks' (e.g. an all-reduce
    through :mod:`fmoe.collectives`, which are no-ops for ``None``).

    Args:
        t: a parameter leaf (plain tensor or DTensor).
    Returns:
        ``(group, size, rank)``; ``(None, 1, 0)`` when ``t`` is not on a tp group.

    Example:
        >>> tp_size_rank(torch.ones(4))
        (None, 1, 0)
    """
    g = axis_group(t, "tp")
    return g, group_size(g), rank_of(g)


#: The sequence dim of an activation ``[..., S, features]`` under sequence parallelism.
SEQ_DIM = -2


def sp_group(t: torch.Tensor) -> tuple[Optional[dist.ProcessGroup], int]:
    """``(tp group, size)`` when ``t`` was placed on a sequence-parallel mesh, else ``(None, 1)``."""
    if not sequence_parallel(t):
        return None, 1
    group, n, _ = tp_size_rank(t)
    return (group, n) if n > 1 else (None, 1)


def scatter_seq(y: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """Partial sums ``[..., S, F]`` summed over the group, each rank keeping its piece
    ``[..., S / n, F]`` (reduce-scatter); backward: the pieces' gradients all-gathered."""
    return reduce_scatter(y, group, dim=SEQ_DIM)


def own_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup], n: int) -> torch.Tensor:
    """This rank's piece ``[..., S / n, F]`` of a sequence replicated over the group; backward:
    the pieces' gradients all-gathered, so every rank holds the full gradient."""
    return local_slice(x, group, [x.shape[SEQ_DIM] // n] * n, dim=SEQ_DIM)
