"""Routers: pure functions from router logits to a routing decision.

A router is any callable ``router(logits[T, E]) -> Routing``. It sees only this rank's token
logits and never communicates, so a scheme written in a notebook runs distributed unchanged:
``fmoe.moe`` does the dispatch. A ``Routing`` holds, per token, ``K`` global expert ids and
the weights their outputs are mixed with, plus ``aux`` (losses and statistics, any tensors).

The Qwen3-MoE / Mixtral scheme is :func:`topk`: softmax over all experts in fp32, keep the
``k`` largest probabilities, optionally renormalise them to sum to one. gpt-oss uses
:func:`topk_softmax`: top-k on the raw logits, softmax over the ``k`` kept logits.

Example:
    >>> import torch
    >>> r = topk(2)(torch.tensor([[0.0, 1.0, 2.0, 3.0]]))
    >>> r.expert_ids.tolist(), [round(w, 4) for w in r.weights[0].tolist()]
    ([[3, 2]], [0.7311, 0.2689])
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

__all__ = ["Routing", "Router", "topk", "topk_softmax", "validate"]


class Routing(NamedTuple):
    """A routing decision for ``T`` tokens.

    Attributes:
        weights: ``[T, K]`` floating mixing weights (differentiable: gradients reach the router).
        expert_ids: ``[T, K]`` int64 global expert ids in ``[0, E)``.
        aux: extra tensors (aux losses, statistics); ``fmoe.moe`` adds load statistics.
    """

    weights: torch.Tensor
    expert_ids: torch.Tensor
    aux: dict


Router = Callable[[torch.Tensor], Routing]


def _check_k(k: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"router: k must be an int >= 1, got k={k!r}")


def _check_logits(logits: torch.Tensor, k: int) -> None:
    if logits.ndim != 2:
        raise ValueError(f"router: logits must be [T, E], got shape {tuple(logits.shape)}")
    if k > logits.shape[1]:
        raise ValueError(f"router: k={k} exceeds the number of experts E={logits.shape[1]}")


def topk(k: int, normalize: bool = True) -> Router:
    """Softmax over experts (fp32) -> top-k -> optional renormalisation (Qwen3-MoE, Mixtral).

    Args:
        k: experts per token (1 <= k <= E).
        normalize: rescale the k kept probabilities to sum to 1.
    Returns:
        a router; its weights are fp32.

    Example:
        >>> topk(1)(torch.zeros(3, 4)).expert_ids.shape
        torch.Size([3, 1])
    """
    _check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        _check_logits(logits, k)
        probs = torch.softmax(logits.float(), dim=-1)                    # [T, E]
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
    _check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        _check_logits(logits, k)
        top, ids = torch.topk(logits.float(), k, dim=-1)                 # [T, K]
        return Routing(torch.softmax(top, dim=-1), ids, {})

    return router


def validate(routing: object, num_tokens: int, num_experts: int) -> Routing:
    """Check what a router returned; raise ``ValueError``/``TypeError`` naming the problem.

    Runs before any communication (one host sync for the id range and NaN check).

    Args:
        routing: the router's return value.
        num_tokens: T, the number of tokens given to the router.
        num_experts: E.
    Returns:
        the routing, with ``expert_ids`` as int64.
    """
    if not isinstance(routing, Routing):
        if isinstance(routing, tuple) and len(routing) == 3:
            routing = Routing(*routing)
        else:
            raise TypeError(f"router must return fmoe.routing.Routing(weights, expert_ids, aux), "
                            f"got {type(routing).__name__}")
    w, ids, aux = routing
    if not isinstance(w, torch.Tensor) or not isinstance(ids, torch.Tensor):
        raise TypeError("router: weights and expert_ids must be tensors")
    if not isinstance(aux, dict):
        raise TypeError(f"router: aux must be a dict, got {type(aux).__name__}")
    if ids.ndim != 2 or ids.shape[0] != num_tokens:
        raise ValueError(f"router: expert_ids must have shape [T={num_tokens}, K], got {tuple(ids.shape)}")
    if w.shape != ids.shape:
        raise ValueError(f"router: weights shape {tuple(w.shape)} must equal expert_ids shape "
                         f"{tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"router: expert_ids must be an integer tensor, got dtype {ids.dtype}")
    if not w.dtype.is_floating_point:
        raise ValueError(f"router: weights must be floating point, got dtype {w.dtype}")
    k = ids.shape[1]
    if k < 1 or k > num_experts:
        raise ValueError(f"router: K={k} experts per token must be in [1, E={num_experts}]")
    if ids.numel():
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"router: expert_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
        if not bool(torch.isfinite(w).all()):
            raise ValueError("router: weights contain NaN or inf")
    return Routing(w, ids.long(), aux)
