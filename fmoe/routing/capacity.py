"""Routers with a per-expert capacity: switch (token choice + dropping) and expert choice.

**Switch** (Switch Transformer, GShard): each token picks its top-k experts by softmax
probability; an expert accepts at most ``C = ceil(capacity_factor * T * k / E)`` assignments,
first come first served in (slot, token) order — all first choices before any second choice,
tokens in batch order. A rejected assignment keeps its expert id with weight 0: the token skips
that expert and (with k = 1) passes through the residual only.

**Expert choice** (Zhou et al. 2022): each expert picks its top ``C`` tokens by softmax score,
``C = min(T, ceil(capacity_factor * T * k / E))``, so every expert is exactly full and a token
may get 0, 1 or several experts. The fixed ``K`` slots of a ``Routing`` hold a token's chosen
experts best-first; spare slots repeat the token's first slot (its best chosen expert, or its
highest-scoring expert if none chose it) with weight 0, so no id leaves ``[0, E)`` and no extra
token is sent. ``K = max_experts``. Zero-weight slots still cost expert compute, so the
default is ``max_experts = min(E, ceil(2 * capacity_factor * k))``: twice the mean number of
experts per token (``capacity_factor * k``), not ``E``. A token chosen by more experts keeps its
best ``max_experts``; the share of the experts' choices cut so is ``aux["truncated_rate"]``
(0 in the exact form, ``max_experts=E``).

**Statistics** (each a GlobalStat over all data-parallel batches, logged by the trainer):

- ``drop_rate``: one definition for both routers: the fraction of **tokens** that no expert
  processes (every slot weight 0; they pass through the residual only). For switch with
  ``k = 1`` this is also the fraction of assignments dropped.
- ``load_routed`` (``[E]``): the load *before* capacity, each token's top-k experts by score
  (switch: the assignments it asked for; expert choice: what token choice would have sent),
  beside the layer's ``load`` after dropping; the trainer logs ``maxvio_routed`` from it.

Both decide over **this rank's tokens only**: under data parallelism the capacity and the
competition are per data-parallel batch (the ranks of a tensor-parallel group hold the same
batch and agree). The result equals a single process run on that batch, not on the union.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from ..precision import upcast
from .global_stats import GlobalStat
from .core import Router, Routing, check_k, check_logits

__all__ = ["switch", "expert_choice", "capacity"]


def _rate(numerator: torch.Tensor, denominator: torch.Tensor) -> GlobalStat:
    return GlobalStat({"dropped": numerator, "total": denominator},
                      lambda s: s["dropped"] / s["total"].clamp(min=1))


def _statistics(weights: torch.Tensor, wanted: torch.Tensor, num_experts: int) -> dict:
    """``drop_rate`` (tokens with every slot at weight 0) and ``load_routed`` (``wanted [T, k]``
    counted per expert), as GlobalStats."""
    dropped = (weights.detach() == 0).all(-1).sum().float()                  # tokens no expert takes
    counts = torch.zeros(num_experts, dtype=torch.int64, device=wanted.device)
    counts = counts.scatter_add(0, wanted.reshape(-1), torch.ones_like(wanted.reshape(-1)))   # [E]
    return {"drop_rate": _rate(dropped, weights.new_tensor(float(weights.shape[0]), dtype=torch.float32)),
            "load_routed": GlobalStat({"load_routed": counts}, lambda s: s["load_routed"])}


def _check_factor(capacity_factor: float) -> None:
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) or capacity_factor <= 0:
        raise ValueError(f"router: capacity_factor must be a number > 0, got {capacity_factor!r}")


def capacity(num_tokens: int, num_experts: int, k: int, capacity_factor: float) -> int:
    """Assignments one expert accepts: ``ceil(capacity_factor * T * k / E)``.

    Example:
        >>> capacity(10, 4, 1, 1.0)
        3
    """
    return math.ceil(capacity_factor * num_tokens * k / num_experts - 1e-9)


def switch(capacity_factor: float = 1.25, k: int = 1, normalize: bool = False) -> Router:
    """Softmax top-k with a per-expert capacity; overflow assignments get weight 0.

    Args:
        capacity_factor: capacity relative to a perfectly balanced load.
        k: experts per token (Switch: 1; GShard: 2).
        normalize: renormalise the k kept probabilities before dropping.
    Returns:
        a router with ``aux["drop_rate"]`` and ``aux["load_routed"]`` (module docstring).

    Example:
        >>> r = switch(capacity_factor=1.0)(torch.tensor([[2.0, 0.0], [1.0, 0.0]]))
        >>> r.expert_ids.tolist(), (r.weights > 0).tolist()
        ([[0], [0]], [[True], [False]])
    """
    _check_factor(capacity_factor)
    check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        T, E = logits.shape
        probs = torch.softmax(upcast(logits), dim=-1)                             # [T, E]
        weights, ids = torch.topk(probs, k, dim=-1)                               # [T, K]
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        C = capacity(T, E, k, capacity_factor)
        slot_major = F.one_hot(ids.t().reshape(-1), E)                            # [K*T, E]
        position = (slot_major.cumsum(0) * slot_major).sum(-1) - 1                # [K*T]
        keep = (position < C).reshape(k, T).t()                                   # [T, K]
        weights = torch.where(keep, weights, 0.0)
        return Routing(weights, ids, _statistics(weights, ids, E))

    return router


def expert_choice(capacity_factor: float = 1.0, k: int = 1, max_experts: Optional[int] = None) -> Router:
    """Each expert picks its top-C tokens by softmax score (tokens may get 0 or several experts).

    Args:
        capacity_factor, k: ``C = min(T, ceil(capacity_factor * T * k / E))`` tokens per expert
            (on average ``capacity_factor * k`` experts per token).
        max_experts: slots per token, K (default ``min(E, ceil(2 * capacity_factor * k))``;
            ``E``: exact). A token chosen by more experts keeps its best ones.
    Returns:
        a router with ``aux["drop_rate"]`` (fraction of tokens that no expert chose),
        ``aux["load_routed"]`` and ``aux["truncated_rate"]`` (module docstring), and
        ``aux["uses_future_tokens"]`` (1): each expert picks from the whole batch, so a token's
        routing depends on the tokens after it; its held-out loss (``eval_...``) is optimistic
        against a causal router's, and the log row says so (``eval_uses_future_tokens``).

    Example:
        >>> r = expert_choice(k=1)(torch.log(torch.tensor([[.7, .3], [.6, .4], [.2, .8]])))
        >>> r.expert_ids.tolist(), [[round(w, 2) for w in row] for row in r.weights.tolist()]
        ([[0, 0], [0, 1], [1, 1]], [[0.7, 0.0], [0.6, 0.4], [0.8, 0.0]])
    """
    _check_factor(capacity_factor)
    check_k(k)
    if max_experts is not None:
        check_k(max_experts, "max_experts")

    def router(logits: torch.Tensor) -> Routing:
        T, E = logits.shape if logits.ndim == 2 else (0, 0)
        K = min(E, math.ceil(2 * capacity_factor * k - 1e-9)) if max_experts is None else max_experts
        check_logits(logits, max(K, k))
        scores = torch.softmax(upcast(logits), dim=-1)                            # [T, E]
        C = min(T, capacity(T, E, k, capacity_factor))
        chosen_tok = scores.topk(C, dim=0).indices                                # [C, E]
        chosen = torch.zeros(T, E, dtype=torch.bool, device=logits.device).scatter(0, chosen_tok, True)  # [T, E]
        # per token: chosen experts first (best score first), then the rest (best first)
        rank_key = torch.where(chosen, scores.detach() + 2.0, scores.detach())
        ids = rank_key.topk(K, dim=-1).indices                                    # [T, K]
        used = chosen.gather(1, ids)                                              # [T, K]
        ids = torch.where(used, ids, ids[:, :1])                                  # spare -> slot 0
        weights = torch.where(used, scores.gather(1, ids), 0.0)
        cut = (chosen.sum(-1) - used.sum(-1)).sum().float()                   # choices beyond K slots
        aux = _statistics(weights, scores.detach().topk(k, dim=-1).indices, E)
        aux["truncated_rate"] = _rate(cut, scores.new_tensor(float(C * E), dtype=torch.float32))
        aux["uses_future_tokens"] = torch.tensor(1.0, device=logits.device)   # an expert ranks the whole batch
        return Routing(weights, ids, aux)

    router.no_balance_loss = "every expert takes exactly C tokens: the load is balanced by construction"
    return router
