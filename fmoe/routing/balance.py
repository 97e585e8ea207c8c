"""Load balancing as router pieces: biased selection for every router family, the balance
losses with the router's own scores, and the sums a global-batch balance loss needs.

Three ways to balance a router's load (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing";
Qiu et al. 2025, "Demons in the Detail"), all pure functions of the logits:

- **expert bias** (aux-loss-free): a per-expert bias ``b [E]`` is added to the scores *only to
  choose* the top-k; the weights stay the unbiased scores. :func:`biased_topk` (softmax scores:
  Qwen3-MoE, Mixtral) and :func:`biased_topk_softmax` (top-k on the logits: gpt-oss) are the
  biased twins of :func:`fmoe.routing.topk` / :func:`fmoe.routing.topk_softmax` (with ``b = 0``
  they route identically); DeepSeek-V3's :func:`fmoe.routing.sigmoid_topk` reads the bias
  itself. :func:`fmoe.routing.update_bias` moves ``b`` after each optimizer step;
- **balance losses** (Switch ``E * sum_e f_e P_e``, sequence-wise, z-loss):
  :func:`fmoe.routing.with_losses` with ``probs`` = the router's own score function
  (:data:`SCORES`: softmax for softmax routers, the normalised sigmoid for sigmoid routers);
- **global-batch balance**: :func:`with_balance_sums` adds the sums ``f`` and ``P`` are made of
  (``balance_count [E]`` all slots, ``balance_prob [E]`` differentiable, ``balance_tokens``) as
  :class:`fmoe.routing.global_stats.GlobalStat` entries, so ``fmoe.moe`` returns them summed over the
  data-parallel batches; a trainer sums the counts over its gradient-accumulation micro-batches
  too and weighs each micro-batch's ``balance_prob`` by them (:func:`global_balance_loss`).

Example:
    >>> r = biased_topk(1, normalize=False)(torch.zeros(1, 3), expert_bias=torch.tensor([0., 1., 0.]))
    >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[1]], [0.3333])
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from .global_stats import GlobalStat
from .aux_losses import normalized_sigmoid, softmax_probs
from .core import Router, Routing, active, check_k, check_logits
from .inputs import accepted, call
from .state import state_of
from ..precision import upcast

__all__ = ["reads_bias", "SCORES", "biased_topk", "biased_topk_softmax", "with_balance_sums", "global_balance_loss",
           "BALANCE_SUMS"]

#: score function name -> ``probs(logits) -> [T, E]`` the balance losses use for that router family.
SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"softmax": softmax_probs,
                                                             "sigmoid": normalized_sigmoid}

#: aux entries :func:`with_balance_sums` adds (summed over the data-parallel batches by ``fmoe.moe``).
BALANCE_SUMS = ("balance_count", "balance_prob", "balance_tokens")


def reads_bias(router: Callable) -> bool:
    """Whether ``router`` takes the ``expert_bias`` keyword (so a bias in params changes its choice).

    Example:
        >>> import fmoe
        >>> reads_bias(fmoe.routing.sigmoid_topk(2)), reads_bias(fmoe.routing.topk(2))
        (True, False)
    """
    var_kw, names, _ = accepted(router)
    return var_kw or "expert_bias" in names


def _bias(expert_bias: Optional[torch.Tensor], E: int) -> Optional[torch.Tensor]:
    if expert_bias is None:
        return None
    if not isinstance(expert_bias, torch.Tensor) or tuple(expert_bias.shape) != (E,):
        raise ValueError(f"router: expert_bias must be a [E={E}] tensor, got "
                         f"{tuple(expert_bias.shape) if isinstance(expert_bias, torch.Tensor) else type(expert_bias).__name__}")
    return expert_bias.detach().float()


def biased_topk(k: int, normalize: bool = True) -> Router:
    """:func:`fmoe.routing.topk` whose *selection* adds ``expert_bias`` to the softmax scores.

    Args:
        k: experts per token.
        normalize: rescale the k kept probabilities to sum to 1.
    Returns:
        ``router(logits, *, expert_bias=None)``; weights are the unbiased probabilities.

    Example:
        >>> x = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
        >>> biased_topk(2)(x, expert_bias=torch.zeros(4)).expert_ids.tolist()
        [[3, 2]]
    """
    check_k(k)

    def router(logits: torch.Tensor, *, expert_bias: Optional[torch.Tensor] = None) -> Routing:
        check_logits(logits, k)
        probs = torch.softmax(upcast(logits), dim=-1)                            # [T, E]
        b = _bias(expert_bias, logits.shape[1])
        if b is None:
            weights, ids = torch.topk(probs, k, dim=-1)                          # [T, K]
        else:
            ids = (probs.detach() + b).topk(k, dim=-1).indices
            weights = probs.gather(1, ids)
        if normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights, ids, {})

    return router


def biased_topk_softmax(k: int) -> Router:
    """:func:`fmoe.routing.topk_softmax` (gpt-oss) whose selection adds ``expert_bias`` to the
    logits; the weights are the softmax over the k chosen *unbiased* logits.

    Example:
        >>> r = biased_topk_softmax(1)(torch.tensor([[1.0, 0.0]]), expert_bias=torch.tensor([0.0, 2.0]))
        >>> r.expert_ids.tolist(), r.weights.tolist()
        ([[1]], [[1.0]])
    """
    check_k(k)

    def router(logits: torch.Tensor, *, expert_bias: Optional[torch.Tensor] = None) -> Routing:
        check_logits(logits, k)
        b = _bias(expert_bias, logits.shape[1])
        if b is None:
            top, ids = torch.topk(upcast(logits), k, dim=-1)                     # [T, K]
        else:
            ids = (upcast(logits.detach()) + b).topk(k, dim=-1).indices
            top = upcast(logits).gather(1, ids)
        return Routing(torch.softmax(top, dim=-1), ids, {})

    return router


def with_balance_sums(router: Router, probs: Callable[[torch.Tensor], torch.Tensor] = softmax_probs) -> Router:
    """Add the global-batch balance sums to a router's aux (see the module docstring).

    Args:
        router: any router (it receives every keyword input).
        probs: the score function of the balance loss (:data:`SCORES`).
    Returns:
        ``router(logits, **inputs)`` with ``aux["balance_count"]`` (``[E]`` slots per expert),
        ``aux["balance_prob"]`` (``[E]`` sum of ``probs`` over tokens, differentiable) and
        ``aux["balance_tokens"]`` (T), each a GlobalStat of its own sum.

    Example:
        >>> import fmoe
        >>> r = with_balance_sums(fmoe.routing.topk(1))(torch.zeros(2, 2))
        >>> r.aux["balance_prob"].local().tolist(), r.aux["balance_tokens"].local().item()
        ([1.0, 1.0], 2.0)
    """
    if not callable(router) or not callable(probs):
        raise TypeError(f"with_balance_sums: router and probs must be callable, got {router!r}, {probs!r}")

    def wrapped(logits: torch.Tensor, **inputs) -> Routing:
        routing = call(router, logits, inputs)
        if not isinstance(routing, Routing):
            routing = Routing(*routing)
        T, E = logits.shape
        ids, on = active(routing.expert_ids.reshape(-1))                       # inactive slots count 0
        count = torch.zeros(E, dtype=torch.float32, device=logits.device).index_add(0, ids, on.float())    # [E]
        sums = {"balance_count": count, "balance_prob": probs(logits).float().sum(0),
                "balance_tokens": torch.tensor(float(T), device=logits.device)}
        aux = dict(routing.aux)
        for name, t in sums.items():
            aux[name] = GlobalStat({name: t}, lambda s, name=name: s[name])
        return Routing(routing.weights, routing.expert_ids, aux)

    wrapped.__name__ = f"with_balance_sums({getattr(router, '__name__', 'router')})"
    wrapped.state = state_of(router)               # the wrapped router's state (fmoe.routing.state)
    return wrapped


def global_balance_loss(count: torch.Tensor, tokens: torch.Tensor, prob: torch.Tensor) -> torch.Tensor:
    """Switch loss ``E * sum_e f_e * P_e`` from sums over the *global* batch.

    Args:
        count: ``[E]`` slots per expert over every batch and micro-batch of the step (constant).
        tokens: total tokens of the step (scalar).
        prob: ``[E]`` summed probabilities; a micro-batch's own sums give that micro-batch's
            share of the loss (the shares add up to the loss of the step, and so do their gradients).
    Returns:
        a scalar tensor (1.0 for perfectly balanced uniform routing over the whole step).

    Example:
        >>> global_balance_loss(torch.tensor([2., 2.]), torch.tensor(2.), torch.tensor([1., 1.]))
        tensor(1.)
    """
    E = count.shape[0]
    f = count.detach().float() / count.detach().float().sum().clamp(min=1)       # [E], sums to 1
    return E * (f * prob.float()).sum() / tokens.detach().float().clamp(min=1)
