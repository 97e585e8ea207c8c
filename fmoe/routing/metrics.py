"""Load-balance metrics as the papers report them, from the routed load per expert.

``load [E]`` counts the routed assignments per expert (``fmoe.moe``'s ``aux["load"]``: over all
data-parallel batches; a trainer sums it over its micro-batches, an evaluation over its
held-out batches). Per MoE layer::

    maxvio = (max_e load_e - mean_e load_e) / mean_e load_e      (Wang et al. 2024; 0 = balanced)
    dead   = number of experts with load_e == 0

Summed over more tokens (a whole evaluation) the same formula is the *global* MaxVio; over one
step's batch it is the *batch* MaxVio. :func:`load_metrics` gives both lists per layer and
percentiles of MaxVio across layers (linear interpolation, as ``torch.quantile``).

Example:
    >>> maxvio(torch.tensor([3, 1, 0, 0])).item()
    2.0
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["maxvio", "dead_experts", "load_metrics", "PERCENTILES"]

#: percentiles of MaxVio across layers reported by :func:`load_metrics`.
PERCENTILES = (50, 90)


def maxvio(load: torch.Tensor) -> torch.Tensor:
    """``(max - mean) / mean`` of the load over the last dim (0.0 where nothing is routed).

    Args:
        load: ``[..., E]`` counts.
    Returns:
        ``[...]`` float64.

    Example:
        >>> maxvio(torch.tensor([[2, 2], [0, 0]])).tolist()
        [0.0, 0.0]
    """
    load = load.detach().to(torch.float64)
    mean = load.mean(-1)
    return torch.where(mean > 0, (load.amax(-1) - mean) / mean.clamp(min=1e-300), torch.zeros_like(mean))


def dead_experts(load: torch.Tensor) -> torch.Tensor:
    """Experts that received no assignment, per row of ``load [..., E]``.

    Example:
        >>> dead_experts(torch.tensor([3, 0, 1, 0])).item()
        2
    """
    return (load.detach() == 0).sum(-1)


def load_metrics(loads: Sequence[torch.Tensor], prefix: str = "", suffix: str = "") -> dict:
    """Log-row metrics of per-layer loads: ``maxvio`` (list per layer), its mean, percentiles
    across layers and max, ``dead_experts`` (list per layer); keys start with ``prefix`` and
    carry ``suffix`` after the metric's name (``maxvio_routed_mean``).

    Args:
        loads: one ``[E]`` load per MoE layer, in layer order (empty: no metrics).
        prefix: e.g. ``"eval_"``.
        suffix: e.g. ``"_routed"`` (the load before capacity dropped assignments).
    Returns:
        a dict of floats / lists of numbers (JSON-ready).

    Example:
        >>> m = load_metrics([torch.tensor([2, 2]), torch.tensor([4, 0])])
        >>> m["maxvio"], m["maxvio_max"], m["dead_experts"]
        ([0.0, 1.0], 1.0, [0, 1])
        >>> sorted(load_metrics([torch.tensor([2, 2])], "eval_", "_routed"))[:2]
        ['eval_dead_experts_routed', 'eval_maxvio_routed']
    """
    loads = list(loads)
    if not loads:
        return {}
    v = maxvio(torch.stack([lo.detach().cpu().to(torch.float64) for lo in loads]))        # [L]
    name = f"{prefix}maxvio{suffix}"
    out = {name: v.tolist(), f"{name}_mean": float(v.mean()), f"{name}_max": float(v.max())}
    for p in PERCENTILES:
        out[f"{name}_p{p}"] = float(torch.quantile(v, p / 100))
    out[f"{prefix}dead_experts{suffix}"] = [int(d) for d in dead_experts(torch.stack([lo.detach().cpu() for lo in loads]))]
    return out
