"""AdamW as pure functions over parameter trees (optax-style), with global-norm clipping.

``state = init(params)``; ``params, state = update(grads, state, params, lr=1e-3)``. The
trainer calls :func:`step`, the same update that also returns its statistics (gradient norm,
clip scale, whether it was skipped). Parameters, gradients and moments share placements
(DTensors with identical placements, or plain tensors), so the elementwise math runs on local
shards with no communication and no per-op DTensor dispatch.

The one global quantity is the gradient norm. Each element must be counted exactly once,
whatever the mesh: a shard replicated on ``n`` ranks contributes ``local_sq / n`` on each of
them and one all-reduce over the world sums the result. (Counting expert shards once per efsdp
copy, or TP-replicated norms once per TP rank, is the classic MoE grad-norm bug.)

No host sync: the step counter is a tensor, bias corrections are tensor math and a non-finite
gradient norm selects the old values with ``torch.where`` (nothing changes, the counter does
not advance). So a whole step (``torch.func.grad_and_value`` + :func:`update`) compiles with
``torch.compile(..., fullgraph=True)`` on one process (see the README's "Transforms").

Weight decay is decoupled and masked by path globs: by default tensors with fewer than 2 dims
(norm weights, biases) are not decayed. To freeze leaves, leave them out of ``grads``
(:func:`fmoe.optim.masks.partition`) or pass ``mask``.

Example:
    >>> import torch
    >>> p = {"w": torch.ones(2, 2)}
    >>> s = init(p)
    >>> p2, s2 = update({"w": torch.ones(2, 2)}, s, p, lr=0.1)
    >>> round(p2["w"][0, 0].item(), 4), int(s2["step"])
    (0.89, 1)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch

from .. import tree as _tree
from ..sharding import local_shard, placed_like
from .kernels import adam, fusable, fused_adamw
from .norm import clip_scale, global_norm, local_square_sum, norm_of

__all__ = ["AdamWConfig", "init", "update", "step", "step_flat", "apply_flat", "global_norm"]


@dataclass(frozen=True)
class AdamWConfig:
    """AdamW hyper-parameters.

    Attributes:
        betas, eps, weight_decay: as in ``torch.optim.AdamW``.
        max_grad_norm: clip the global gradient norm to this (None: no clipping).
        no_decay: path globs excluded from weight decay (None: every tensor with < 2 dims).
    """

    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    max_grad_norm: Optional[float] = 1.0
    no_decay: Optional[Sequence[str]] = None


def init(params: Any, dtype: Optional[torch.dtype] = None) -> dict:
    """Optimizer state: a step counter and first/second moments shaped (and placed) like ``params``.

    Args:
        params: parameter tree (plain tensors or DTensors).
        dtype: dtype of the moments (default: each parameter's own; ``torch.bfloat16`` for the
            pure-bf16 policy of :mod:`fmoe.precision`).
    Returns:
        ``{"step": int64 scalar, "m": tree, "v": tree}``.

    Example:
        >>> sorted(init({"w": torch.ones(2)}))
        ['m', 'step', 'v']
    """
    zeros = lambda _, p: placed_like(torch.zeros_like(local_shard(p), dtype=dtype), p)  # noqa: E731
    return {"step": torch.zeros((), dtype=torch.int64),
            "m": _tree.map_with_path(zeros, params), "v": _tree.map_with_path(zeros, params)}


def _decays(path: str, p: Any, cfg: AdamWConfig) -> bool:
    if cfg.no_decay is None:
        return p.ndim >= 2
    return not any(_tree.glob_match(g, path) for g in cfg.no_decay)


#: elements per piece of a donated (in-place) update: its temporaries stay ~12 x 16 MB
DONATE_PIECE = 1 << 22


def step(grads: Any, state: dict, params: Any, lr: Union[float, torch.Tensor], cfg: AdamWConfig = AdamWConfig(),
         mask: Optional[Any] = None, rounding: Optional[torch.Generator] = None,
         donate: bool = False) -> tuple[Any, dict, dict]:
    """One AdamW step with global-norm clipping, and its statistics (what the trainer logs).

    Args:
        grads: gradients (same structure and placements as ``params``, or a flat ``{path: grad}``
            dict; already reduced over data-parallel ranks); leaves that do not require grad
            may be absent and are then left unchanged.
        state: from :func:`init` (or a previous step).
        params: parameter tree.
        lr: learning rate of this step (a float, or a scalar tensor: no recompile per value).
        cfg: hyper-parameters.
        mask: optional tree (or flat dict) of bools, True where a leaf is trained
            (:func:`fmoe.optim.masks.mask`); False leaves are left as they are.
        rounding: random source of the stochastic rounding of bf16 weights
            (:func:`fmoe.precision.round_generator`; None: round to nearest).
        donate: write the new weights and moments into the given ones' storage (the same
            numbers; the caller gives up the old trees, as JAX's buffer donation, and the
            gradients too: they may be left scaled by the clip), so no second copy of params and
            moments is held (by pieces of :data:`DONATE_PIECE` elements where the fused kernel
            does not apply).
    Returns:
        ``(new_params, new_state, {"grad_norm", "clip_scale", "skipped"})`` (tensors); when the
        norm is NaN/Inf nothing changes (``skipped`` True, the counter does not advance).
    """
    flat_p, flat_g = _tree.flatten(params), _tree.flatten(grads)
    flat_m, flat_v = _tree.flatten(state["m"]), _tree.flatten(state["v"])
    keep = None if mask is None else _tree.flatten(mask)
    new_p, new_m, new_v, count, stats = step_flat(flat_g, flat_m, flat_v, flat_p, state["step"], lr, cfg,
                                                  mask=keep, rounding=rounding, donate=donate)
    new_state = {"step": count, "m": _tree.unflatten(new_m, like=params), "v": _tree.unflatten(new_v, like=params)}
    return _tree.unflatten(new_p, like=params), new_state, stats


def step_flat(flat_g: dict, flat_m: dict, flat_v: dict, flat_p: dict, count: torch.Tensor,
              lr: Union[float, torch.Tensor], cfg: AdamWConfig = AdamWConfig(), mask: Optional[dict] = None,
              rounding: Optional[torch.Generator] = None, donate: bool = False) -> tuple[dict, dict, dict, torch.Tensor, dict]:
    """:func:`step` on flat ``{path: leaf}`` dicts, as the train step holds them (no tree walk).

    Args:
        flat_g: gradients by path; every leaf of ``flat_p`` that requires grad has one.
        flat_m, flat_v: the moments by path (``state["m"]`` / ``state["v"]`` flattened).
        flat_p: the parameters by path.
        count: ``state["step"]``.
        lr, cfg, rounding, donate: as in :func:`step`.
        mask: optional ``{path: bool}``, False where a leaf is not trained (as :func:`step`'s).
    Returns:
        ``(new_p, new_m, new_v, new_count, stats)``: dicts in ``flat_p``'s order; with
        ``donate`` an unchanged entry is the given leaf itself.

    Example:
        >>> p, g = {"w": torch.zeros(2)}, {"w": torch.ones(2)}
        >>> new_p, _, _, count, _ = step_flat(g, {"w": torch.zeros(2)}, {"w": torch.zeros(2)}, p,
        ...                                   torch.zeros((), dtype=torch.int64), lr=0.5)
        >>> new_p["w"].tolist(), int(count)
        ([-0.5, -0.5], 1)
    """
    if mask is not None:
        flat_g = {k: g for k, g in flat_g.items() if mask.get(k, True)}
    missing = sorted(k for k in set(flat_p) - set(flat_g) if flat_p[k].requires_grad and
                     (mask is None or mask.get(k, True)))
    if missing:
        raise ValueError(f"adamw: no gradient for {missing[:5]} (freeze leaves with requires_grad=False, "
                         "fmoe.optim.partition or mask=)")
    leaves = [flat_g[k] for k in sorted(flat_g)]           # the order of global_norm(flat_g)
    norm = norm_of(local_square_sum(leaves), leaves)
    finite = torch.isfinite(norm)
    scale = clip_scale(norm, cfg)
    count = count + finite.to(count.dtype)                  # advances only when applied
    new_p, new_m, new_v = apply_flat(flat_g, flat_m, flat_v, flat_p, count, lr, cfg, scale=scale, finite=finite,
                                     rounding=rounding, donate=donate)
    stats = {"grad_norm": norm, "clip_scale": torch.where(finite, scale, 0), "skipped": ~finite}
    return new_p, new_m, new_v, count, stats


def apply_flat(flat_g: dict, flat_m: dict, flat_v: dict, flat_p: dict, count: torch.Tensor,
               lr: Union[float, torch.Tensor], cfg: AdamWConfig, *, scale: torch.Tensor, finite: torch.Tensor,
               rounding: Optional[torch.Generator] = None, donate: bool = False) -> tuple[dict, dict, dict]:
    """The AdamW update of the leaves of ``flat_p`` that have a gradient in ``flat_g``, with the
    clip ``scale`` and the ``finite`` gate already known (:func:`step_flat` computes them from the
    global norm; :mod:`fmoe.training.optim_backward` applies it to one layer at a time).

    Args:
        flat_g, flat_m, flat_v, flat_p: gradients (reduced), moments and parameters by path;
            a parameter without a gradient is left as it is.
        count: the step counter after this step (the bias corrections' ``t``).
        lr, cfg, rounding, donate: as in :func:`step`.
        scale: the gradient factor (:func:`clip_scale`); finite: a bool tensor, False: nothing written.
    Returns:
        ``(new_p, new_m, new_v)`` in ``flat_p``'s order (with ``donate`` an unchanged entry is
        the given leaf itself).
    """
    b1, b2 = cfg.betas
    t = count.to(torch.float64).clamp(min=1)
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    new_p, new_m, new_v = {}, {}, {}
    fused: dict = {}                                 # (dtype, device, decay) -> [(path, g, m, v, p)]
    with torch.no_grad():
        for path, p in flat_p.items():
            if path not in flat_g:                   # frozen (e.g. router state): left as it is
                new_p[path], new_m[path], new_v[path] = p, flat_m[path], flat_v[path]
                continue
            g0, m0, v0, p0 = local_shard(flat_g[path]), local_shard(flat_m[path]), local_shard(flat_v[path]), local_shard(p)
            wd = cfg.weight_decay if _decays(path, p, cfg) else 0.0
            if rounding is None and fusable(g0, m0, v0, p0):
                if not donate:                       # the kernel writes in place: into copies
                    g0, m0, v0, p0 = g0.clone(), m0.clone(), v0.clone(), p0.clone()
                fused.setdefault((p0.dtype, p0.device, wd), []).append((path, g0, m0, v0, p0))
                continue
            hyper = (scale, b1, b2, bc1, bc2, lr, wd, cfg.eps)
            if donate and all(x.is_contiguous() for x in (p0, m0, v0)):   # in place, by pieces
                fg, fp, fm, fv = g0.reshape(-1), p0.view(-1), m0.view(-1), v0.view(-1)
                for a in range(0, fp.numel(), DONATE_PIECE):
                    sl = slice(a, a + DONATE_PIECE)
                    for old_t, new_t in zip((fp[sl], fm[sl], fv[sl]),
                                            adam(fg[sl], fm[sl], fv[sl], fp[sl], hyper, finite, rounding)):
                        old_t.copy_(new_t)
                new_p[path], new_m[path], new_v[path] = p, flat_m[path], flat_v[path]
                continue
            pl, m, v = adam(g0, m0, v0, p0, hyper, finite, rounding)
            new_p[path] = placed_like(pl, p).requires_grad_(p.requires_grad)
            new_m[path], new_v[path] = placed_like(m, flat_m[path]), placed_like(v, flat_v[path])
        for (dtype, device, wd), group in fused.items():
            fused_adamw([x[1:] for x in group], t, scale, finite, lr, cfg, wd)
            for path, _, m, v, pl in group:
                p = flat_p[path]
                new_p[path] = p if donate else placed_like(pl, p).requires_grad_(p.requires_grad)
                new_m[path] = flat_m[path] if donate else placed_like(m, flat_m[path])
                new_v[path] = flat_v[path] if donate else placed_like(v, flat_v[path])
    return new_p, new_m, new_v


def update(grads: Any, state: dict, params: Any, lr: Union[float, torch.Tensor], cfg: AdamWConfig = AdamWConfig(),
           mask: Optional[Any] = None) -> tuple[Any, dict]:
    """One AdamW step: ``params, state = update(grads, state, params, lr=1e-3)`` (:func:`step`
    without its statistics).

    Args:
        grads, state, params, lr, cfg, mask: as in :func:`step`.
    Returns:
        ``(new_params, new_state)``.

    Example:
        >>> p = {"w": torch.zeros(3)}
        >>> p, s = update({"w": torch.ones(3)}, init(p), p, lr=0.5)
        >>> p["w"].tolist()
        [-0.5, -0.5, -0.5]
    """
    new_params, new_state, _ = step(grads, state, params, lr, cfg, mask)
    return new_params, new_state
