"""One training step as a pure function: ``(params, opt_state, batch) -> (params, opt_state, metrics)``.

Per rank: forward on this rank's batch (TP ranks share one), mean cross-entropy over its tokens
plus the weighted router aux losses, gradients by autograd, data-parallel reduction to the
per-batch mean (:mod:`fmoe.train.grads`), AdamW with global-norm clipping
(:mod:`fmoe.train.optim`). The result equals one process training on the union of all batches.

Token accounting counts each batch once, whatever ``tp`` is: a step processes
``batch * seq * dp_replicate * fsdp`` tokens.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import tree as _tree
from ..mesh import Mesh
from ..nn import cross_entropy
from ..regather import regather_in_backward
from .grads import reduce_grads
from .optim import AdamWConfig, adamw_update

__all__ = ["StepConfig", "train_step", "forward_with_aux"]


@dataclass(frozen=True)
class StepConfig:
    """What a step needs besides the trees.

    Attributes:
        opt: AdamW hyper-parameters.
        aux_weight: weight of the router aux losses (sum over layers) in the loss.
        impl: MoE dispatch implementation passed to the model.
    """

    opt: AdamWConfig = AdamWConfig()
    aux_weight: float = 0.0
    impl: str = "auto"


def forward_with_aux(model: Any, params: Any, tokens: torch.Tensor, cfg: Any, mesh: Optional[Mesh],
                     impl: str = "auto") -> tuple[torch.Tensor, dict]:
    """Logits and the model's aux (``{"moe": [per-layer dicts]}``; empty for dense models)."""
    sig = inspect.signature(model.forward).parameters
    kwargs = {}
    if "impl" in sig:
        kwargs["impl"] = impl
    if "return_aux" in sig:
        return model.forward(params, tokens, cfg, mesh, return_aux=True, **kwargs)
    return model.forward(params, tokens, cfg, mesh, **kwargs), {}


def _world_mean(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().clone().float()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return x


def _aux_terms(aux: dict) -> tuple[torch.Tensor, dict]:
    """Sum of every ``*_loss`` entry over layers, and per-name sums for metrics."""
    total, named = None, {}
    for layer in aux.get("moe", []):
        for k, v in layer.items():
            if k.endswith("_loss") and isinstance(v, torch.Tensor) and v.ndim == 0:
                named[k] = named.get(k, 0.0) + v
                total = v if total is None else total + v
    return total, named


def train_step(model: Any, cfg: Any, params: Any, opt_state: dict, batch: tuple[torch.Tensor, torch.Tensor],
               *, mesh: Mesh, step_cfg: StepConfig, lr: float) -> tuple[Any, dict, dict]:
    """One optimizer step.

    Args:
        model: a model module (``forward``) from :mod:`fmoe.models`.
        cfg: its Config.
        params: parameter tree (leaves require grad), as placed by ``fmoe.shard``.
        opt_state: from :func:`fmoe.train.optim.adamw_init`.
        batch: ``(tokens [B, S], targets [B, S])`` of this rank's data-parallel batch.
        mesh: the training mesh.
        step_cfg: :class:`StepConfig`.
        lr: learning rate of this step.
    Returns:
        ``(params, opt_state, metrics)``; metrics are floats/lists equal on every rank:
        ``loss`` (mean over all batches), aux losses, ``grad_norm``, ``lr``, ``tokens``,
        ``step_time``, ``tokens_per_s``, ``expert_load`` (tokens per expert per layer, all batches).

    Example:
        >>> # params, opt_state, m = train_step(llama, cfg, params, opt_state, batch,
        >>> #                                   mesh=mesh, step_cfg=StepConfig(), lr=1e-3)
    """
    t0 = time.perf_counter()
    tokens, targets = batch
    leaves = _tree.leaves(params)
    with regather_in_backward():
        logits, aux = forward_with_aux(model, params, tokens, cfg, mesh, step_cfg.impl)
        loss = cross_entropy(logits, targets)
        aux_total, aux_named = _aux_terms(aux)
        total = loss if aux_total is None or not step_cfg.aux_weight else loss + step_cfg.aux_weight * aux_total
        grads = torch.autograd.grad(total, leaves)
    grads = reduce_grads(_tree.unflatten(dict(zip(_tree.paths(params), grads)), like=params), params, mesh)
    params, opt_state, stats = adamw_update(params, grads, opt_state, step_cfg.opt, lr)
    dt = time.perf_counter() - t0
    n_tokens = tokens.numel() * mesh.num_batches
    metrics = {"loss": float(_world_mean(loss)), "grad_norm": float(stats["grad_norm"]), "lr": lr,
               "tokens": n_tokens, "step_time": dt, "tokens_per_s": n_tokens / dt}
    for k, v in aux_named.items():
        metrics[k] = float(_world_mean(v))
    loads = [layer["tokens_per_expert"] for layer in aux.get("moe", []) if "tokens_per_expert" in layer]
    if loads:
        load = torch.stack(loads).double()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(load)
            load /= mesh.tp                              # each batch is held by tp ranks
        metrics["expert_load"] = load.round().long().tolist()
        mean = load.mean(dim=1).clamp(min=1e-9)
        metrics["load_imbalance"] = float((load.max(dim=1).values / mean).mean())
    return params, opt_state, metrics
