"""Functional AdamW over parameter pytrees, global-norm clipping and the learning-rate schedule.

Everything is a pure function of trees: ``state = adamw_init(params)``;
``params, state, stats = adamw_update(params, grads, state, cfg, lr)``. Parameters, gradients
and moments share placements (DTensors with identical placements, or plain tensors), so the
elementwise math runs on local shards with no communication and no per-op DTensor dispatch.

The one global quantity is the gradient norm. Each element must be counted exactly once,
whatever the mesh: a shard replicated on ``n`` ranks contributes ``local_sq / n`` on each of
them and a single all-reduce over the world sums the result. (Counting expert shards once per
efsdp copy, or TP-replicated norms once per TP rank, is the classic MoE grad-norm bug.)

Weight decay is decoupled (AdamW) and masked by path globs: by default tensors with fewer than
2 dims (norm weights, biases, router biases) are not decayed.

Example:
    >>> import torch
    >>> p = {"w": torch.ones(2, 2)}
    >>> s = adamw_init(p)
    >>> p2, s2, stats = adamw_update(p, {"w": torch.ones(2, 2)}, s, AdamWConfig(), lr=0.1)
    >>> round(p2["w"][0, 0].item(), 4), round(stats["grad_norm"].item(), 4)
    (0.89, 2.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate

from .. import tree as _tree
from ..collectives import sum_over_world
from ..precision import store
from ..sharding import placed_like

__all__ = ["AdamWConfig", "adamw_init", "adamw_update", "global_norm", "lr_at"]


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


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _like(local: torch.Tensor, ref: Any) -> Any:
    """Wrap a new local tensor with ``ref``'s placement (:func:`fmoe.sharding.placed_like`)."""
    return placed_like(local, ref)


def adamw_init(params: Any, dtype: Optional[torch.dtype] = None) -> dict:
    """Optimizer state: step counter and first/second moments shaped (and placed) like params,
    in ``dtype`` (default: each parameter's own; see :mod:`fmoe.precision`)."""
    zeros = _tree.map_with_path(lambda _, p: _like(torch.zeros_like(_local(p), dtype=dtype), p), params)
    zeros2 = _tree.map_with_path(lambda _, p: _like(torch.zeros_like(_local(p), dtype=dtype), p), params)
    return {"step": torch.zeros((), dtype=torch.int64), "m": zeros, "v": zeros2}


def _replicas(t: Any) -> int:
    if not isinstance(t, DTensor):
        return 1
    n = 1
    for size, pl in zip(t.device_mesh.shape, t.placements):
        if isinstance(pl, Replicate):
            n *= size
    return n


def global_norm(tree: Any) -> torch.Tensor:
    """The L2 norm of all leaves together, each element counted once across the world.

    Args:
        tree: gradients (DTensors or plain tensors); Partial placements must be reduced first.
    Returns:
        a scalar fp32 tensor, equal on every rank.
    """
    total = torch.zeros((), dtype=torch.float64)
    for leaf in _tree.leaves(tree):
        total = total + _local(leaf).double().square().sum() / _replicas(leaf)
    return sum_over_world(total).sqrt().float()


def _decays(path: str, p: Any, cfg: AdamWConfig) -> bool:
    if cfg.no_decay is None:
        return p.ndim >= 2
    return not any(_tree.glob_match(g, path) for g in cfg.no_decay)


#: elements per piece of an in-place (donated) update: its fp32 temporaries stay ~12 x 16 MB
DONATE_PIECE = 1 << 22


def _adam(g, m, v, p, hyper, rounding):
    """One AdamW update of local tensors in fp32; returns (p, m, v) stored in their own dtypes."""
    scale, b1, b2, bc1, bc2, lr, wd, eps = hyper
    g = g.float() * scale                                  # fp32 math on any stored dtype
    m_new = m.float() * b1 + g * (1 - b1)
    v_new = v.float() * b2 + g.square() * (1 - b2)
    pl = p.float()
    if wd:
        pl = pl * (1 - lr * wd)
    denom = (v_new / bc2).sqrt().add_(eps)
    pl = pl - lr * (m_new / bc1) / denom
    return store(pl, p.dtype, rounding), store(m_new, m.dtype), store(v_new, v.dtype)


def adamw_update(params: Any, grads: Any, state: dict, cfg: AdamWConfig, lr: float,
                 rounding: Optional[torch.Generator] = None, donate: bool = False) -> tuple[Any, dict, dict]:
    """One AdamW step with global-norm clipping.

    Args:
        params: parameter tree.
        grads: gradients (same structure and placements, or a flat ``{path: grad}`` dict;
            already reduced over data-parallel ranks); leaves that do not require grad may be
            absent and are then left unchanged.
        state: from :func:`adamw_init` (or a previous update).
        cfg: hyper-parameters.
        lr: learning rate for this step.
        rounding: random source of the stochastic rounding of bf16 weights
            (:func:`fmoe.precision.round_generator`; None: round to nearest). The math runs in
            fp32 whatever the stored dtypes; weights and moments are written back in their own.
        donate: write the new weights and moments into the given ones' storage (the same
            numbers; the caller gives up the old trees, as JAX's buffer donation): the update
            then holds no second copy of params and moments, and runs by pieces of
            :data:`DONATE_PIECE` elements, so its fp32 temporaries stay small.
    Returns:
        ``(new_params, new_state, {"grad_norm": norm before clipping, "clip_scale": scale})``;
        when the norm is NaN/Inf nothing is updated: ``(params, state, {..., "skipped": True})``.
    """
    norm = global_norm(grads)
    if not bool(torch.isfinite(norm)):             # never apply a non-finite update
        return params, state, {"grad_norm": norm, "clip_scale": torch.zeros(()), "skipped": True}
    scale = torch.ones(())
    if cfg.max_grad_norm is not None:
        scale = torch.clamp(cfg.max_grad_norm / (norm + 1e-6), max=1.0)
    step = int(state["step"]) + 1
    b1, b2 = cfg.betas
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    flat_p, flat_g = _tree.flatten(params), _tree.flatten(grads)
    flat_m, flat_v = _tree.flatten(state["m"]), _tree.flatten(state["v"])
    missing = sorted(k for k in set(flat_p) - set(flat_g) if flat_p[k].requires_grad)
    if missing:
        raise ValueError(f"adamw_update: no gradient for {missing[:5]} (frozen leaves must not require grad)")
    new_p, new_m, new_v = {}, {}, {}
    with torch.no_grad():
        for path, p in flat_p.items():
            if path not in flat_g:                   # frozen (e.g. expert_bias): left as it is
                new_p[path], new_m[path], new_v[path] = p, flat_m[path], flat_v[path]
                continue
            hyper = (scale, b1, b2, bc1, bc2, lr, cfg.weight_decay if _decays(path, p, cfg) else 0.0, cfg.eps)
            lp, lm, lv, lg = _local(p), _local(flat_m[path]), _local(flat_v[path]), _local(flat_g[path])
            if donate and all(t.is_contiguous() for t in (lp, lm, lv)):   # in place, by pieces
                fg = lg.reshape(-1)
                fp, fm, fv = lp.view(-1), lm.view(-1), lv.view(-1)
                for a in range(0, fp.numel(), DONATE_PIECE):             # same values, bounded temporaries
                    sl = slice(a, a + DONATE_PIECE)
                    for old_t, new_t in zip((fp[sl], fm[sl], fv[sl]),
                                            _adam(fg[sl], fm[sl], fv[sl], fp[sl], hyper, rounding)):
                        old_t.copy_(new_t)
                new_p[path], new_m[path], new_v[path] = p, flat_m[path], flat_v[path]
                continue
            pl, m, v = _adam(lg, lm, lv, lp, hyper, rounding)
            new_p[path] = _like(pl, p).requires_grad_(p.requires_grad)
            new_m[path], new_v[path] = _like(m, flat_m[path]), _like(v, flat_v[path])
    return (_tree.unflatten(new_p, like=params),
            {"step": torch.tensor(step), "m": _tree.unflatten(new_m, like=params),
             "v": _tree.unflatten(new_v, like=params)},
            {"grad_norm": norm, "clip_scale": scale})


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup for ``warmup`` steps, then cosine decay to ``min_ratio * base_lr`` at ``total``.

    ``step`` counts from 1 (the first update).

    Example:
        >>> [round(lr_at(s, 1.0, 2, 10), 3) for s in (1, 2, 10)]
        [0.5, 1.0, 0.1]
    """
    if step <= warmup:
        return base_lr * step / max(1, warmup)
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))
