"""Routers whose choice ignores the logits: hash routing, and balanced / random for benchmarks.

- :func:`hash_router` (Hash Layers, Roller et al. 2021): a token's experts are a fixed function
  of its token id, so the same vocabulary item always meets the same experts. It needs the token
  ids, a per-token input: ``fmoe.moe(..., router_inputs={"token_ids": tokens.reshape(-1)})``.
- :func:`balanced`: token ``t`` (its position in this rank's batch) gets experts
  ``(t*k + j) mod E``: every expert receives exactly ``T*k/E`` rows when ``E`` divides ``T*k``.
- :func:`random_topk`: ``k`` distinct uniformly random experts per token, reproducible from
  ``(seed, T)``.

The weights still come from the logits (softmax over the chosen logits, or constant with a zero
gradient for the hash router without gate), so the router weight is in the graph and receives a
gradient (zero, never missing). Balanced and random depend on positions in this rank's batch,
so a distributed run equals a single process on the same batch.
"""

from __future__ import annotations

import torch

from ..precision import upcast
from .core import Router, Routing, check_k, check_logits

#: Why a balance loss does not fit these routers (``router.no_balance_loss``, :mod:`fmoe.routing.core`).
FIXED = "its experts do not depend on the router's scores, so a balance loss cannot move the load"

__all__ = ["hash_router", "token_hash", "balanced", "random_topk"]

_GOLDEN = 2654435761          # Knuth's multiplicative hash constant (odd, ~2^32 / phi)


def token_hash(token_ids: torch.Tensor, num_experts: int, salt: int = 0) -> torch.Tensor:
    """Expert of each token id: ``((id + salt) * 2654435761 mod 2^32) >> 16  mod E``.

    Args:
        token_ids: integer tensor (ids below 2^31).
        num_experts: E.
        salt: varies the mapping (one salt per slot).
    Returns:
        int64 tensor of the same shape, values in ``[0, E)``.

    Example:
        >>> token_hash(torch.tensor([0, 1, 2]), 8).tolist()
        [0, 7, 6]
    """
    h = ((token_ids.long() + salt) * _GOLDEN) % (1 << 32)
    return (h >> 16) % num_experts


def _constant_weights(logits: torch.Tensor, ids: torch.Tensor, value: float) -> torch.Tensor:
    """``value`` everywhere, with a zero gradient to the logits (keeps the router in the graph)."""
    return upcast(logits).gather(1, ids) * 0.0 + value


def hash_router(k: int = 1, seed: int = 0, gate: bool = False) -> Router:
    """Fixed experts per token id; slot ``j`` uses :func:`token_hash` with salt ``seed*k + j``.

    Args:
        k: experts per token (slots may repeat an expert).
        seed: changes the mapping.
        gate: weights = softmax of the chosen logits (trainable gate); otherwise ``1/k`` each
            (Hash Layers), with a zero gradient to the router.
    Returns:
        ``router(logits, *, token_ids)``; ``token_ids`` is ``[T]`` integer, aligned with x's rows.

    Example:
        >>> r = hash_router()(torch.zeros(3, 8), token_ids=torch.tensor([0, 1, 2]))
        >>> r.expert_ids.tolist(), r.weights.tolist()
        ([[0], [7], [6]], [[1.0], [1.0], [1.0]])
    """
    check_k(k)

    def router(logits: torch.Tensor, *, token_ids: torch.Tensor) -> Routing:
        check_logits(logits, 1)
        T, E = logits.shape
        if (not isinstance(token_ids, torch.Tensor) or token_ids.shape != (T,)
                or token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool):
            got = (f"{tuple(token_ids.shape)} {token_ids.dtype}" if isinstance(token_ids, torch.Tensor)
                   else type(token_ids).__name__)
            raise ValueError(f"hash_router: token_ids must be a [T={T}] integer tensor, got {got}")
        ids = torch.stack([token_hash(token_ids, E, seed * k + j) for j in range(k)], dim=-1)
        ids = ids.to(logits.device)                                               # [T, K]
        if gate:
            return Routing(torch.softmax(upcast(logits).gather(1, ids), -1), ids, {})
        return Routing(_constant_weights(logits, ids, 1.0 / k), ids, {})

    router.no_balance_loss = FIXED
    return router


def balanced(k: int = 1) -> Router:
    """Round-robin experts by position: token ``t`` slot ``j`` -> expert ``(t*k + j) mod E``.

    Weights are the softmax of the chosen logits.

    Example:
        >>> balanced(2)(torch.zeros(3, 4)).expert_ids.tolist()
        [[0, 1], [2, 3], [0, 1]]
    """
    check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        T, E = logits.shape
        pos = torch.arange(T * k, device=logits.device).reshape(T, k)
        ids = pos % E                                                             # [T, K]
        return Routing(torch.softmax(upcast(logits).gather(1, ids), -1), ids, {})

    router.no_balance_loss = FIXED
    return router


def random_topk(k: int = 1, seed: int = 0) -> Router:
    """``k`` distinct random experts per token, seeded by ``(seed, T)``; softmax of their logits.

    Example:
        >>> r = random_topk(2, seed=1)(torch.zeros(5, 4))
        >>> bool((r.expert_ids[:, 0] != r.expert_ids[:, 1]).all()), r.weights[0].tolist()
        (True, [0.5, 0.5])
    """
    check_k(k)

    def router(logits: torch.Tensor) -> Routing:
        check_logits(logits, k)
        T, E = logits.shape
        g = torch.Generator().manual_seed((seed * 1_000_003 + T) & 0xFFFF_FFFF_FFFF_FFFF)
        ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices.to(logits.device)
        return Routing(torch.softmax(upcast(logits).gather(1, ids), -1), ids, {})

    router.no_balance_loss = FIXED
    return router
