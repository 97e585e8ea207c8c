"""Gather a layer's FSDP-split weights in one collective instead of one per weight.

``fmoe.materialize`` all-gathers each weight split over ``fsdp``/``efsdp`` when a layer function
uses it: one collective per weight in forward, one reduce-scatter per weight in backward (and
one more all-gather per weight when :func:`fmoe.regather.regather_in_backward` re-gathers it).
A transformer layer has about ten such weights, and on a CPU process group each collective is a
rendezvous of every rank: per-weight gathering costs more than the bytes it moves.

Inside ``with prefetch(layer_params):`` every leaf of the subtree that ``materialize`` would
gather over exactly one axis on one dim is gathered up front, all leaves that share a process
group and dtype in ONE all-gather; ``materialize`` hands out those tensors. The backward of that
gather is ONE reduce-scatter of all their gradients (the same sum over the gathering ranks as
the per-weight path: gradients are identical), and ``regather_in_backward`` re-gathers the
group with one collective. Model files iterate ``for layer in prefetch_layers(params["layers"])``.

Leaves with nothing to gather (the default plans: dense weights replicated, experts on ``ep``)
pass through, so the loop is free when there is no FSDP.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Optional

import torch
from torch.distributed.tensor import DTensor

from . import tree as _tree
from .collectives import group_size

__all__ = ["prefetch", "prefetch_layers", "prefetched"]

KEEP = ("tp", "ep")          # axes a layer keeps split (it runs its own collectives for them)
_ACTIVE: dict[int, tuple[torch.Tensor, str]] = {}     # id(leaf) -> (gathered tensor, axis)


def _gather_axis(t: DTensor) -> Optional[tuple[int, str]]:
    """``(dim, axis)`` when ``materialize`` would gather ``t`` over exactly one axis on one
    (unpacked, unmixed) dim; None otherwise (left to ``materialize``)."""
    from .sharding import placement_of

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


class _GatherMany(torch.autograd.Function):
    """Full tensors of several local shards in one all-gather; backward: one reduce-scatter."""

    @staticmethod
    def forward(ctx, group, dims, *locals_):
        from .regather import gather_flat

        ctx.group, ctx.dims, ctx.shapes = group, dims, [t.shape for t in locals_]
        ctx.dtype, ctx.device = locals_[0].dtype, locals_[0].device
        return tuple(gather_flat(locals_, dims, group))

    @staticmethod
    def backward(ctx, *grads):
        import torch.distributed as dist

        n = group_size(ctx.group)
        rows = []
        for g, d, shape in zip(grads, ctx.dims, ctx.shapes):
            if g is None:                  # a weight the layer did not use
                full = list(shape)
                full[d] *= n
                g = torch.zeros(full, dtype=ctx.dtype, device=ctx.device)
            pieces = torch.stack(g.split(shape[d], dim=d))                           # [n, *local]
            rows.append(pieces.reshape(n, -1))
        send = torch.cat(rows, dim=1)                                                # [n, total]
        out = send.new_empty(send.shape[1])
        dist.reduce_scatter_tensor(out, send.reshape(-1), group=ctx.group)
        sizes = [int(torch.Size(s).numel()) for s in ctx.shapes]
        return (None, None) + tuple(o.view(s) for o, s in zip(out.split(sizes), ctx.shapes))


@contextlib.contextmanager
def prefetch(params: Any) -> Iterator[None]:
    """Within the block, ``fmoe.materialize`` of the subtree's FSDP-split leaves returns
    tensors gathered together (one collective per process group and dtype).

    Args:
        params: a subtree of parameters (e.g. one layer's dict), DTensors or plain tensors.

    Example:
        >>> with prefetch({"w": torch.ones(2)}):    # plain tensors: nothing to gather
        ...     pass
    """
    from .regather import register_gathered_group
    from .sharding import to_local

    todo: dict[tuple, list] = {}
    for leaf in _tree.leaves(params):
        if isinstance(leaf, DTensor) and id(leaf) not in _ACTIVE:
            found = _gather_axis(leaf)
            if found is not None:
                group = leaf.device_mesh.get_group(found[1])
                if group_size(group) > 1 and leaf.shape[found[0]] % group_size(group) == 0:  # uneven: per leaf
                    todo.setdefault((id(group), leaf.dtype), []).append((leaf, found, group))
    added = []
    try:
        for members in todo.values():
            group = members[0][2]
            locals_ = [to_local(leaf) for leaf, _, _ in members]
            dims = [d for _, (d, _), _ in members]
            fulls = _GatherMany.apply(group, dims, *locals_)
            register_gathered_group(fulls, locals_, group, dims)     # lets regather_in_backward drop them
            for (leaf, (_, axis), _), full in zip(members, fulls):
                _ACTIVE[id(leaf)] = (full, axis)
                added.append(id(leaf))
        yield
    finally:
        for key in added:
            _ACTIVE.pop(key, None)


def prefetched(t: Any, keep: Iterable[str]) -> Optional[torch.Tensor]:
    """The tensor gathered for ``t`` by an enclosing :func:`prefetch` if it is what
    ``materialize(t, keep)`` would return, else None."""
    hit = _ACTIVE.get(id(t)) if _ACTIVE else None
    if hit is None or hit[1] in keep:
        return None
    return hit[0]


def prefetch_layers(layers: Iterable[Any]) -> Iterator[Any]:
    """Iterate over layer subtrees, each inside :func:`prefetch` while the loop body runs.

    Example:
        >>> [len(layer) for layer in prefetch_layers([{"w": torch.ones(1)}])]
        [1]
    """
    for layer in layers:
        with prefetch(layer):
            yield layer
