"""Decoding caches as pure pytrees: fixed-size per-layer buffers written out of place.

A cache is a nested dict of tensors, built by a model's ``init_cache(cfg, batch, max_len,
mesh)`` and threaded through ``forward(..., cache=cache, positions=pos) -> (logits, cache)``::

    {"length": int64 [] (slots filled so far),
     "mask":   bool [B, L] (slot holds a real token, not left padding),
     "layers": [{"k": [B, L, G, hd], "v": [B, L, G, hd]}, ...]}   # per model: MLA keeps a latent

Slots ``[length, length + S)`` receive the ``S`` new tokens; attention then runs over the first
``length + S`` slots with the new tokens as the last queries (:func:`fmoe.nn.attention`'s
convention), padding slots hidden by ``mask``. ``positions [B, S]`` are the rotary positions of
the new tokens, ``-1`` for left padding (its slot stays hidden); by default ``length + arange(S)``.

Per-head buffers (``k``, ``v``) are sharded like the heads: with a mesh their head dim is split
over ``tp`` (a DTensor ``P(None, None, "tp", None)``); a model whose cache is shared by all
heads (MLA's latent) keeps it replicated. Every write returns new tensors, so the cache that
went in is unchanged: decoding is a pure function of the cache.

Example:
    >>> c = init_cache(2, 8, [{"k": (1, 4), "v": (1, 4)}])
    >>> st = begin(torch.zeros(2, 3, dtype=torch.long), c, None)
    >>> entry, (k, v) = write(c["layers"][0], st, k=torch.ones(2, 3, 1, 4), v=torch.ones(2, 3, 1, 4))
    >>> k.shape, int(finish(c, st, [entry])["length"])
    (torch.Size([2, 3, 1, 4]), 3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch

from ..sharding import P, placed_like, shard, to_local

__all__ = ["Step", "init_cache", "kv_cache", "begin", "write", "finish", "outputs"]


@dataclass(frozen=True)
class Step:
    """One forward call's view of the cache.

    Attributes:
        positions: rotary positions ``[S]`` or ``[B, S]`` of the new tokens.
        start: first slot written (0 without a cache).
        key_mask: ``[B, start + S]`` bool visible-key table, or None when every key is real.
    """

    positions: torch.Tensor
    start: int
    key_mask: Optional[torch.Tensor]


def init_cache(batch: int, max_len: int, layers: Sequence[Mapping[str, tuple]], *,
               dtype: torch.dtype = torch.float32, device: Any = None, mesh: Any = None,
               split_heads: Sequence[str] = ()) -> dict:
    """An empty cache (see the module docstring).

    Args:
        batch: B sequences.
        max_len: L slots (prompt + generated tokens).
        layers: per layer, ``{name: per-slot shape}`` (e.g. ``{"k": (G, hd), "v": (G, hd)}``).
        dtype: buffer dtype (the activations' dtype).
        device: buffer device.
        mesh: an :class:`fmoe.Mesh`; entries named in ``split_heads`` have their first per-slot
            dim (heads) split over ``tp``.
        split_heads: entry names sharded like the attention heads.
    Returns:
        the cache pytree.
    """
    for name, v in (("batch", batch), ("max_len", max_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"init_cache: {name} must be an int >= 1, got {v!r}")
    tp = 1 if mesh is None else mesh.tp
    out = []
    for i, layer in enumerate(layers):
        entry = {k: torch.zeros((batch, max_len, *shape), dtype=dtype, device=device) for k, shape in layer.items()}
        if tp > 1:
            for k in split_heads:
                if k in entry and entry[k].shape[2] % tp:
                    raise ValueError(f"init_cache: layer {i} cache {k!r} has {entry[k].shape[2]} heads, not "
                                     f"divisible by tp={tp}")
            rules = {k: P(None, None, "tp") if k in split_heads else P() for k in entry}
            entry = shard(entry, rules, mesh)
        out.append(entry)
    return {"length": torch.zeros((), dtype=torch.long), "mask": torch.zeros(batch, max_len, dtype=torch.bool,
                                                                            device=device), "layers": out}


def begin(tokens: torch.Tensor, cache: Optional[dict], positions: Optional[torch.Tensor]) -> Step:
    """Positions, first slot and key mask for ``tokens [B, S]`` (``cache`` may be None).

    Raises ``ValueError`` (before any compute) when the cache is too short or ``positions``
    has the wrong shape.
    """
    B, S = tokens.shape
    if positions is not None:
        if not isinstance(positions, torch.Tensor) or positions.dtype.is_floating_point or \
                tuple(positions.shape) not in ((S,), (B, S)):
            raise ValueError(f"forward: positions must be an integer [S={S}] or [B={B}, S={S}] tensor, got "
                             f"{getattr(positions, 'dtype', type(positions).__name__)} "
                             f"{tuple(getattr(positions, 'shape', ()))}")
        positions = positions.to(tokens.device)
    if cache is None:
        if positions is None:
            return Step(torch.arange(S, device=tokens.device), 0, None)
        real = (positions >= 0).expand(B, S)
        return Step(positions, 0, None if bool(real.all()) else real)
    if not isinstance(cache, dict) or not {"length", "mask", "layers"} <= set(cache):
        raise ValueError("forward: cache must come from the model's init_cache (keys length, mask, layers)")
    start = int(cache["length"])
    L = cache["mask"].shape[1]
    if cache["mask"].shape[0] != B or start + S > L:
        raise ValueError(f"forward: the cache holds batch {cache['mask'].shape[0]} x {L} slots with {start} "
                         f"filled; {B} x {S} new tokens do not fit (init_cache with a larger max_len)")
    if positions is None:
        positions = start + torch.arange(S, device=tokens.device)
    real = (positions >= 0).expand(B, S)
    return Step(positions, start, torch.cat([cache["mask"][:, :start].to(tokens.device), real], dim=1))


def write(entry: dict, step: Step, **new: torch.Tensor) -> tuple[dict, tuple[torch.Tensor, ...]]:
    """Write the new tokens' tensors ``[B, S, ...]`` into slots ``[start, start + S)``.

    Args:
        entry: one layer's cache dict.
        step: from :func:`begin`.
        new: ``name=tensor`` for entries of ``entry`` (this rank's heads).
    Returns:
        ``(new entry, views)``: the updated dict and, in the order given, each buffer's first
        ``start + S`` slots (this rank's local tensors) to attend over.
    """
    out, views = dict(entry), []
    for name, x in new.items():
        buf = to_local(entry[name])
        if buf.shape[0] != x.shape[0] or buf.shape[2:] != x.shape[2:]:
            raise ValueError(f"cache: entry {name!r} holds [B, L, ...] = {tuple(buf.shape)} on this rank but the "
                             f"layer computed {tuple(x.shape)}; build the cache with init_cache(cfg, batch, "
                             "max_len, mesh) on the mesh and plan the parameters use")
        S = x.shape[1]
        buf = buf.slice_scatter(x.to(buf.dtype), dim=1, start=step.start, end=step.start + S)
        out[name] = placed_like(buf, entry[name])
        views.append(buf[:, :step.start + S])
    return out, tuple(views)


def finish(cache: dict, step: Step, layers: list) -> dict:
    """The cache after this call: ``length`` advanced, the new slots' mask set, new layers."""
    S = step.key_mask.shape[1] - step.start
    mask = cache["mask"].slice_scatter(step.key_mask[:, step.start:].to(cache["mask"].device), dim=1,
                                       start=step.start, end=step.start + S)
    return {"length": torch.tensor(step.start + S, dtype=torch.long), "mask": mask, "layers": layers}


def outputs(logits: torch.Tensor, cache: Optional[dict], step: Step, entries: list,
            aux: Optional[dict] = None) -> Any:
    """What a model's ``forward`` returns: ``logits``, then the new cache when one was given,
    then ``aux`` when asked for (a tuple when more than the logits)."""
    out = (logits,) + (() if cache is None else (finish(cache, step, entries),)) + (() if aux is None else (aux,))
    return out if len(out) > 1 else logits


def kv_cache(num_layers: int, num_kv_heads: int, head_dim: int, batch: int, max_len: int, mesh: Any = None,
             dtype: torch.dtype = torch.float32) -> dict:
    """:func:`init_cache` of per-head keys and values ``[B, L, G, hd]`` per layer, split over
    tp like the KV heads (the usual GQA cache)."""
    kv = {"k": (num_kv_heads, head_dim), "v": (num_kv_heads, head_dim)}
    return init_cache(batch, max_len, [kv] * num_layers, dtype=dtype, mesh=mesh, split_heads=("k", "v"))
