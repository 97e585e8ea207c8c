"""ReLU routing with an adaptive L1 penalty (ReMoE, Liu et al., ICLR 2025), a stateful router.

Each expert's gate is ``relu(logit)``: a token uses the experts whose gate is positive, a number
that varies per token. An L1 penalty ``l1_coef * mean_t sum_e gate[t, e]`` pushes gates to zero,
and ``l1_coef`` is router state (:mod:`fmoe.routing.state`) moved after every step from the
global batch's mean number of active experts per token (the ``active`` statistic)::

    l1_coef <- l1_coef * alpha ** sign(active - k)      # denser than k: stronger penalty

so the routing settles at ``k`` experts per token on average. The state lives in the parameter
tree (``layers.i.moe.l1_coef``), so a resumed run continues it bitwise.

Slots: exact ReMoE gives each token all ``E`` slots, the inactive ones (gate 0) marked with
expert id ``-1`` (:data:`fmoe.routing.core.INACTIVE`): the dispatch neither sends nor computes
them, so the experts compute the active slots only, about ``k`` per token;
``max_experts=M`` keeps each token's ``M`` largest gates only.

Example:
    >>> r = remoe(k=1)
    >>> out = r(torch.tensor([[1.0, -1.0, 2.0]]), l1_coef=torch.tensor(0.1))
    >>> out.expert_ids.tolist(), out.weights.tolist(), float(out.aux["active"].local())
    ([[0, -1, 2]], [[1.0, 0.0, 2.0]], 2.0)
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import upcast
from .core import INACTIVE, Loss, Router, Routing, check_k, check_logits
from .global_stats import GlobalStat
from .state import RouterState, with_state

__all__ = ["remoe"]


def remoe(k: int = 2, alpha: float = 1.2, l1_init: float = 1e-3, max_experts: Optional[int] = None) -> Router:
    """ReLU routing whose L1 coefficient adapts toward ``k`` active experts per token.

    Args:
        k: the target mean number of active experts per token.
        alpha: the coefficient's factor per step (> 1).
        l1_init: the coefficient's initial value (> 0).
        max_experts: slots per token (default all ``E``: exact; fewer keeps the largest gates).
    Returns:
        ``router(logits, *, l1_coef)`` with state ``{"l1_coef": scalar}``, aux ``l1_loss`` (a
        :class:`fmoe.routing.Loss`) and ``active`` (mean active experts per token, global).
    """
    check_k(k)
    if max_experts is not None:
        check_k(max_experts, "max_experts")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 1:
        raise ValueError(f"remoe: alpha must be a number > 1, got {alpha!r}")
    if isinstance(l1_init, bool) or not isinstance(l1_init, (int, float)) or not l1_init > 0:
        raise ValueError(f"remoe: l1_init must be a number > 0, got {l1_init!r}")

    def router(logits: torch.Tensor, *, l1_coef: torch.Tensor) -> Routing:
        check_logits(logits, 1)
        T, E = logits.shape
        gates = torch.relu(upcast(logits))                                          # [T, E]
        M = E if max_experts is None else min(max_experts, E)
        if M < E:
            weights, ids = gates.topk(M, dim=-1)                                     # [T, M]
        else:
            weights, ids = gates, torch.arange(E, device=logits.device).expand(T, E)
        ids = torch.where(weights > 0, ids, torch.full_like(ids, INACTIVE))         # gate 0: inactive slot
        active = GlobalStat({"n": (gates > 0).sum().float(), "t": gates.new_tensor(float(T))},
                            lambda s: s["n"] / s["t"].clamp(min=1))
        l1 = l1_coef.detach().float() * gates.sum(-1).mean() if T else gates.sum()
        return Routing(weights, ids, {"l1_loss": Loss(l1), "active": active})

    def update(state: dict, stats: dict) -> dict:
        coef = state["l1_coef"]
        return {"l1_coef": coef * torch.tensor(float(alpha), dtype=coef.dtype) ** torch.sign(
            stats["active"].to(coef.dtype) - k)}

    router.no_balance_loss = "ReMoE balances through its own L1 penalty on the gates"
    return with_state(router, RouterState(lambda E: {"l1_coef": torch.tensor(float(l1_init))}, update))
