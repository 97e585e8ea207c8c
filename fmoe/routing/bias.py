"""Aux-loss-free load balancing (DeepSeek-V3): sigmoid scores plus a per-expert selection bias.

Each expert ``e`` has a bias ``b_e`` that is added to its score **only to choose** the top-k
experts; the mixing weights come from the unbiased scores::

    s = sigmoid(logits)                        # [T, E] fp32
    ids = topk(s + b, k)                       # selection (optionally group-limited)
    w = s[ids]; w = w / sum(w) if normalize; w = w * scale

The bias is state, not a trained weight: it lives in the params tree (``moe["expert_bias"]
[E]``), ``fmoe.moe`` hands it to the router detached (it never receives a gradient), and after
each optimizer step a pure function moves it against the observed load::

    b <- b + rate * sign(mean(load) - load)    # overloaded experts become less attractive
    b <- b + rate * (mean(load) - load) / mean(load)     # rule="proportional" (0 when nothing routed)

Use the layer's ``aux["load"]`` (routed assignments per expert over all data-parallel batches,
identical on every rank), so the replicated bias stays identical everywhere. The trainer should
keep ``expert_bias`` out of the optimizer (it has no gradient).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Union

import torch

from .. import tree as _tree
from ..precision import upcast
from ..sharding import local_part, placed_like, to_local
from .core import Router, Routing, check_k, check_logits
from .topk import group_mask

__all__ = ["sigmoid_topk", "update_bias"]


def sigmoid_topk(k: int, normalize: bool = True, scale: float = 1.0, num_groups: int = 1,
                 topk_groups: int = 1, group_top: int = 2) -> Router:
    """Sigmoid scores, selection by ``score + expert_bias``, weights from the scores (DeepSeek-V3).

    Args:
        k: experts per token.
        normalize: rescale the k weights to sum to 1 (before ``scale``).
        scale: multiply the weights (DeepSeek's ``routed_scaling_factor``).
        num_groups: G expert groups for group-limited selection (1: none).
        topk_groups: groups a token may use.
        group_top: a group scores the sum of its best ``group_top`` biased scores (V3: 2).
    Returns:
        ``router(logits, *, expert_bias=None)``; without a bias it is plain sigmoid top-k.

    Example:
        >>> r = sigmoid_topk(1, normalize=False)(torch.zeros(1, 3), expert_bias=torch.tensor([0., 1., 0.]))
        >>> r.expert_ids.tolist(), r.weights.tolist()
        ([[1]], [[0.5]])
    """
    check_k(k)
    for name, v in (("num_groups", num_groups), ("topk_groups", topk_groups), ("group_top", group_top)):
        check_k(v, name)

    def router(logits: torch.Tensor, *, expert_bias: Optional[torch.Tensor] = None) -> Routing:
        check_logits(logits, k)
        E = logits.shape[1]
        scores = torch.sigmoid(upcast(logits))                                    # [T, E]
        choice = scores.detach()
        if expert_bias is not None:
            if not isinstance(expert_bias, torch.Tensor) or tuple(expert_bias.shape) != (E,):
                raise ValueError(f"router: expert_bias must be a [E={E}] tensor, got "
                                 f"{getattr(expert_bias, 'shape', type(expert_bias).__name__)}")
            choice = choice + expert_bias.detach().to(choice.dtype)
        if num_groups > 1:
            choice = torch.where(group_mask(choice, num_groups, topk_groups, group_top), choice, -torch.inf)
        ids = choice.topk(k, dim=-1).indices                                      # [T, K]
        weights = scores.gather(1, ids)
        if normalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * scale, ids, {})

    return router


#: the bias update rules of :func:`update_bias`.
RULES = ("sign", "proportional")


def _step(load: torch.Tensor, rate: float, rule: str) -> torch.Tensor:
    if rule == "sign":
        return torch.sign(load.mean() - load) * rate                             # [E]
    mean = load.mean()
    return torch.where(mean > 0, (mean - load) / mean.clamp(min=1e-300), torch.zeros_like(load)) * rate


def _updated(bias: Any, load: torch.Tensor, rate: float, where: str, rule: str = "sign") -> Any:
    if not isinstance(bias, torch.Tensor):
        raise TypeError(f"update_bias: {where} must be a tensor, got {type(bias).__name__}")
    local = to_local(bias)
    if not isinstance(load, torch.Tensor) or tuple(load.shape) != tuple(bias.shape) or bias.ndim != 1:
        raise ValueError(f"update_bias: load for {where} must be a tensor of shape {tuple(bias.shape)} "
                         f"(one count per expert), got "
                         f"{tuple(load.shape) if isinstance(load, torch.Tensor) else type(load).__name__}")
    with torch.no_grad():
        load = load.detach().to(device=local.device, dtype=torch.float64)
        step = _step(load, rate, rule)                                            # [E]
        if local.shape != step.shape:                      # bias split (fsdp): own block of the step
            step = local_part(step, bias)
        new = local.detach() + step.to(local.dtype)
    return placed_like(new, bias)


def update_bias(params_or_bias: Any, load: Union[torch.Tensor, Mapping[str, torch.Tensor]],
                rate: float = 1e-3, rule: str = "sign") -> Any:
    """Move expert biases against the load: ``b + rate * sign(mean(load) - load)`` (pure).

    Call it after the optimizer step, never inside the forward.

    Args:
        params_or_bias: an ``[E]`` bias tensor (plain or DTensor); a MoE params dict holding
            ``"expert_bias"``; or a model tree, with ``load`` keyed by dotted paths.
        load: ``[E]`` routed assignments per expert (the layer's ``aux["load"]``), or for a model
            tree ``{path: load}`` where path names a MoE params dict (``"layers.0.moe"``) or its
            bias leaf (``"layers.0.moe.expert_bias"``); biases not named are left unchanged.
        rate: step size (DeepSeek-V3: 1e-3).
        rule: ``"sign"`` (DeepSeek-V3, the paper) or ``"proportional"`` (step ``rate *
            (mean - load) / mean``: large violations move faster).
    Returns:
        the same kind of object with new bias tensors (inputs are not modified).

    Example:
        >>> update_bias(torch.zeros(3), torch.tensor([5, 1, 0]), rate=0.1)
        tensor([-0.1000,  0.1000,  0.1000])
    """
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or rate < 0:
        raise ValueError(f"update_bias: rate must be a number >= 0, got {rate!r}")
    if rule not in RULES:
        raise ValueError(f"update_bias: rule must be one of {RULES}, got {rule!r}")
    if isinstance(params_or_bias, torch.Tensor):
        return _updated(params_or_bias, load, rate, "bias", rule)
    if not isinstance(params_or_bias, dict):
        raise TypeError(f"update_bias: params_or_bias must be a tensor or a dict, got "
                        f"{type(params_or_bias).__name__}")
    if isinstance(load, torch.Tensor):
        if "expert_bias" not in params_or_bias:
            raise ValueError(f"update_bias: params has no 'expert_bias' (keys: {sorted(params_or_bias)}); "
                             "for a model tree pass load as {path: load}")
        out = dict(params_or_bias)
        out["expert_bias"] = _updated(out["expert_bias"], load, rate, "params['expert_bias']", rule)
        return out
    if not isinstance(load, Mapping):
        raise TypeError(f"update_bias: load must be a tensor or a mapping of path -> tensor, got "
                        f"{type(load).__name__}")
    flat = _tree.flatten(params_or_bias)
    for path, lo in load.items():
        leaf = path if path.split(".")[-1] == "expert_bias" else f"{path}.expert_bias"
        if leaf not in flat:
            known = [p for p in flat if p.endswith("expert_bias")]
            raise ValueError(f"update_bias: no expert bias at {leaf!r} (from load key {path!r}); "
                             f"biases in the tree: {known[:8]}")
        flat[leaf] = _updated(flat[leaf], lo, rate, leaf, rule)
    return _tree.unflatten(flat, like=params_or_bias)
