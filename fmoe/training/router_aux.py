"""What a training step does with the routers' aux entries: train the losses, log the statistics.

Every entry a router returns is a loss or a statistic, by type (:mod:`fmoe.routing.core`);
``fmoe.moe`` finishes them and records which is which in each layer's ``aux["router_keys"]``.
Per step:

- **losses** (``"loss"``): summed over layers and added to the training loss
  (:func:`losses`); each is logged under its key, averaged over the micro-batches (a float).
- **statistics** (``"stat"``): logged under their key as a list with one value per MoE layer
  (None for a layer without it), each the mean over the micro-batches and the ranks
  (:func:`stat_metrics`; a ``GlobalStat`` already holds the same global value on every rank,
  a plain tensor is this rank's). A scalar logs as a number, a vector as a list.

A router that reports ``load_routed`` (``[E]``, the assignments it chose before any capacity
dropped them: switch, expert choice) also gets ``maxvio_routed`` (and its mean / percentiles /
max, ``dead_experts_routed``) beside the post-drop ``maxvio`` of ``load``
(:func:`fmoe.routing.metrics.load_metrics`; MaxVio is scale-free, so the micro-batch mean of the
load gives the step's value).

Example:
    >>> aux = {"moe": [{"p": torch.tensor(0.5), "n": torch.tensor(2.0), "router_keys": {"p": "loss", "n": "stat"}}]}
    >>> total, named = losses(aux)
    >>> float(total), stats(aux)
    (0.5, {'n': [tensor(2.)]})
"""

from __future__ import annotations

from typing import Any, Collection, Optional, Sequence

import torch
import torch.distributed as dist

from ..collectives import all_reduce_coalesced, group_size, sum_over_world
from ..routing.global_stats import imbalance
from ..routing.metrics import load_metrics

__all__ = ["losses", "stats", "stat_metrics", "step_metrics"]


def _layers(aux: dict) -> list:
    return aux.get("moe", [])


def losses(aux: dict) -> tuple[Optional[torch.Tensor], dict]:
    """``(sum of every loss entry over layers or None, {key: sum over layers})``.

    Args:
        aux: a model's aux (``{"moe": [per-layer dicts from fmoe.moe]}``).
    Returns:
        the total aux loss (None without any) and its terms by key.
    """
    total, named = None, {}
    for layer in _layers(aux):
        for key, kind in layer.get("router_keys", {}).items():
            if kind == "loss":
                v = layer[key]
                named[key] = named[key] + v if key in named else v
                total = v if total is None else total + v
    return total, named


def stats(aux: dict) -> dict:
    """``{key: [per-layer detached tensor or None]}`` of every statistic entry of the routers."""
    layers = _layers(aux)
    keys = list(dict.fromkeys(k for layer in layers for k, kind in layer.get("router_keys", {}).items()
                              if kind == "stat"))
    return {k: [layer[k].detach() if k in layer.get("router_keys", {}) else None for layer in layers] for k in keys}


def _world_means(tensors: Sequence[torch.Tensor], group: Any = None) -> list[torch.Tensor]:
    """Each tensor's mean over all ranks (over ``group``'s when given: one pipeline stage), in
    one all-reduce (float64)."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]) if tensors else torch.zeros(0)
    if group is not None:
        flat = all_reduce_coalesced([flat], group)[0] / group_size(group) if flat.numel() else flat
    elif dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and flat.numel():
        flat = sum_over_world(flat) / dist.get_world_size()
    out, start = [], 0
    for t in tensors:
        out.append(flat[start:start + t.numel()].reshape(t.shape))
        start += t.numel()
    return out


def stat_metrics(per_micro: Sequence[dict], prefix: str = "", group: Any = None) -> dict:
    """Log-row entries of the statistics of one step's micro-batches (each :func:`stats`).

    Args:
        per_micro: one :func:`stats` dict per micro-batch (the same keys and layers in each).
        prefix: prepended to every key (``"eval_"``).
        group: the ranks to average over (default: every rank; a pipeline stage's group).
    Returns:
        ``{key: [per-layer number or list or None]}``, plus the ``_routed`` load metrics when
        every layer reports ``load_routed``. Empty without statistics. Collective: every rank
        calls it.
    """
    if not per_micro or not per_micro[0]:
        return {}
    first = per_micro[0]
    slots = [(k, i) for k, values in first.items() for i, v in enumerate(values) if v is not None]
    means = [torch.stack([m[k][i].to(torch.float64) for m in per_micro]).mean(0) for k, i in slots]
    reduced = dict(zip(slots, _world_means(means, group)))
    out: dict[str, Any] = {}
    for k, values in first.items():
        out[prefix + k] = [reduced[(k, i)].tolist() if (k, i) in reduced else None for i in range(len(values))]
    routed = out.get(prefix + "load_routed")
    if routed and all(v is not None for v in routed):
        out.update(load_metrics([torch.tensor(v) for v in routed], prefix, "_routed"))
    return out


def step_metrics(aux: dict, loads: Optional[list], per_micro: Sequence[dict], n_micro: int,
                 taken: Collection[str] = (), group: Any = None) -> dict:
    """A training step's routing entries of its log row: per MoE layer ``expert_load`` (routed
    slots per expert over all batches), ``load_imbalance`` (max/mean) and the load metrics of
    :func:`fmoe.routing.metrics.load_metrics` (MaxVio, percentiles, dead experts) when every
    layer reports ``load``, then the routers' statistics (:func:`stat_metrics`).

    Args:
        aux: the aux of the step's last micro-batch (``{"moe": [per-layer dicts]}``).
        loads: per layer, the ``load`` summed over the micro-batches (None without MoE layers).
        per_micro: one :func:`stats` dict per micro-batch.
        n_micro: the number of micro-batches (one: each layer's own ``imbalance`` entry).
        taken: the step's other metric names, which no router statistic may reuse.
        group: the ranks whose statistics to average (default: every rank; with pipeline
            parallelism the stage's group, then :func:`fmoe.training.pipeline.join_stages`).
    Returns:
        the entries, in that order. Collective: every rank calls it.
    """
    layers, out = _layers(aux), {}
    if layers and all("load" in layer for layer in layers):
        out["expert_load"] = [load.round().long().tolist() for load in loads]
        out["load_imbalance"] = ([float(layer["imbalance"]) for layer in layers] if n_micro == 1
                                 else [float(imbalance(load)) for load in loads])
        out.update(load_metrics(loads))
    logged = stat_metrics(per_micro, group=group)
    if set(logged) & (set(taken) | set(out)):
        raise ValueError(f"train_step: router statistic(s) {sorted(set(logged) & (set(taken) | set(out)))} collide "
                         "with the step's own metrics; rename them in the router's aux")
    out.update(logged)
    return out
