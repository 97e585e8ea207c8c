"""Token-choice top-k routers: each token picks its ``k`` best experts.

- :func:`topk` (Qwen3-MoE, Mixtral): softmax over all experts in fp32, keep the ``k`` largest
  probabilities, optionally renormalise them to sum to one.
- :func:`topk_softmax` (gpt-oss): top-k on the raw logits, softmax over the ``k`` kept logits.
- :func:`group_topk` (DeepSeek-V2 group-limited greedy): experts form ``G`` equal groups of
  consecutive ids; a token first keeps its ``topk_groups`` best groups (a group scores the sum
  of its ``group_top`` best expert scores: 1 = max, 2 = DeepSeek-V3's top-2 sum), then picks its
  top-k experts inside them. With experts of one group on one node, this bounds how many nodes
  a token is sent to.

All are per-token functions of the logits, so they give the same decision for a token on any
mesh. Ties between equal scores are broken by ``torch.topk`` (unspecified order).
"""

from __future__ import annotations

import torch
from einops import rearrange, repeat

from ..precision import upcast
from .core import Router, Routing, check_k, check_logits

__all__ = ["topk", "topk_softmax", "group_topk", "group_mask"]


def topk(k: int, normalize: bool = True) -> Router:
    """Softmax over experts (fp32) -> top-k -> optional renormalisation (Qwen3-MoE, Mixtral).

    Args:
        k: experts per token (1 <= k <= E).
        normalize: rescale the k kept probabilities to sum to 1.
    Returns:
        a router; its weights are fp32.

    Example:
        >>> r = topk(2)(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
        >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
        ([[3, 2]], [0.7311, 0.2689])
    """
    check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        probs = torch.softmax(upcast(logits), dim=-1)                    # [T, E]
        weights, ids = torch.topk(probs, k, dim=-1)                      # [T, K]
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, ids, {})

    return router


def topk_softmax(k: int) -> Router:
    """Top-k on the raw logits, then softmax over the k kept logits (gpt-oss).

    Example:
        >>> r = topk_softmax(2)(torch.tensor([[0.0, 1.0, 1.0]]))
        >>> r.weights.tolist()
        [[0.5, 0.5]]
    """
    check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        top, ids = torch.topk(upcast(logits), k, dim=-1)                 # [T, K]
        return Routing(torch.softmax(top, dim=-1), ids, {})

    return router


def _check_groups(num_groups: int, topk_groups: int, group_top: int) -> None:
    check_k(num_groups, "num_groups")
    check_k(topk_groups, "topk_groups")
    check_k(group_top, "group_top")
    if topk_groups > num_groups:
        raise ValueError(f"router: topk_groups={topk_groups} exceeds num_groups={num_groups}")


def group_mask(scores: torch.Tensor, num_groups: int, topk_groups: int, group_top: int = 1) -> torch.Tensor:
    """Which experts lie in each token's ``topk_groups`` best groups.

    Args:
        scores: ``[T, E]``; experts ``[g*E/G, (g+1)*E/G)`` form group ``g``.
        num_groups: G (must divide E).
        topk_groups: groups kept per token.
        group_top: a group's score is the sum of its ``group_top`` best expert scores.
    Returns:
        ``[T, E]`` bool.

    Example:
        >>> group_mask(torch.tensor([[0.1, 0.9, 0.5, 0.4]]), 2, 1).tolist()
        [[True, True, False, False]]
    """
    _check_groups(num_groups, topk_groups, group_top)
    E = scores.shape[-1]
    if E % num_groups:
        raise ValueError(f"router: num_groups={num_groups} must divide the number of experts E={E}")
    if group_top > E // num_groups:
        raise ValueError(f"router: group_top={group_top} exceeds the experts per group E/G={E // num_groups}")
    grouped = rearrange(scores, "t (g n) -> t g n", g=num_groups)                 # [T, G, E/G]
    group_score = grouped.topk(group_top, dim=-1).values.sum(-1)                  # [T, G]
    keep = group_score.topk(topk_groups, dim=-1).indices                          # [T, topk_groups]
    gmask = torch.zeros_like(group_score, dtype=torch.bool).scatter(1, keep, True)
    return repeat(gmask, "t g -> t (g n)", n=E // num_groups)


def group_topk(k: int, num_groups: int, topk_groups: int, group_top: int = 1,
               normalize: bool = False, scale: float = 1.0) -> Router:
    """Group-limited top-k over softmax scores (DeepSeek-V2): best groups first, then top-k.

    Args:
        k: experts per token (at most ``topk_groups * E / num_groups``).
        num_groups: G equal groups of consecutive expert ids (G divides E).
        topk_groups: groups a token may use.
        group_top: experts summed into a group's score (1: its max; 2: top-2 sum).
        normalize: renormalise the k weights to sum to 1.
        scale: multiply the weights (DeepSeek's ``routed_scaling_factor``).
    Returns:
        a router; weights are the (fp32) softmax probabilities of the chosen experts.

    Example:
        >>> r = group_topk(2, num_groups=2, topk_groups=1)(torch.log(torch.tensor([[.1, .2, .4, .3]])))
        >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
        ([[2, 3]], [0.4, 0.3])
    """
    check_k(k)
    _check_groups(num_groups, topk_groups, group_top)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        E = logits.shape[1]
        if E % num_groups == 0 and k > topk_groups * (E // num_groups):
            raise ValueError(f"router: k={k} exceeds the experts in {topk_groups} of {num_groups} "
                             f"groups ({topk_groups * (E // num_groups)})")
        probs = torch.softmax(upcast(logits), dim=-1)                              # [T, E]
        mask = group_mask(probs, num_groups, topk_groups, group_top)
        _, ids = torch.where(mask, probs, -1.0).topk(k, dim=-1)                     # [T, K]
        weights = probs.gather(1, ids)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights * scale, ids, {})

    return router
