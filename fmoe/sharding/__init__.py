"""Placements, one package: how a parameter tree is laid out over a mesh.

- :mod:`~fmoe.sharding.placement`: :class:`P`, the mesh axis (or None) of each tensor dim, with
  its validation and the ``torch.chunk`` arithmetic (``chunk_range`` / ``chunk_sizes``);
- :mod:`~fmoe.sharding.plan`: :class:`Plan`, ordered ``(glob, P or style)`` rules over dotted
  paths, ``resolve`` / ``override`` / ``explain``, and ``local_shape``;
- :mod:`~fmoe.sharding.shard`: :func:`shard` (validate, slice, wrap as DTensor), :func:`gather`,
  :func:`placement_of` (read from the DTensor spec), :func:`sequence_parallel` (the leaf was placed
  on a sequence-parallel mesh), :func:`local_shard` (a leaf's storage on
  this rank), and the per-rank blocks checkpoint reads use;
- :mod:`~fmoe.sharding.local`: :func:`to_local` (the differentiable local slice for compute),
  :func:`grad_placements`, :func:`placed_like` and :func:`local_part`;
- :mod:`~fmoe.sharding.dtensor_rules`: the DTensor rule torch lacks for forward mode, and the
  refusals of the transform nestings a sharded leaf cannot serve.

Example:
    >>> import torch
    >>> from fmoe.sharding import P, Plan
    >>> Plan({"layers.*.w": P("tp", None)}).resolve({"layers": {"0": {"w": torch.ones(4, 2)}}})
    {'layers': {'0': {'w': P('tp', None)}}}
"""

from .local import grad_placements, local_part, placed_like, to_local
from .placement import P, check_fused_gate_up, chunk_range, chunk_sizes
from .plan import STYLES, Plan, local_shape, style
from .shard import (dtensor_placements, from_local_slice, gather, local_shard, placement_of, rank_blocks,
                    sequence_parallel, shard, slice_for_rank)

__all__ = ["P", "Plan", "STYLES", "style", "shard", "gather", "placement_of", "to_local", "local_shard", "placed_like",
           "local_part", "grad_placements", "dtensor_placements", "rank_blocks", "slice_for_rank", "from_local_slice",
           "local_shape", "check_fused_gate_up", "chunk_range", "chunk_sizes", "sequence_parallel"]
