"""The router contract: ``Routing``, its validation, and how a router receives extra inputs.

A router is any callable ``router(logits[T, E]) -> Routing``. It sees only this rank's token
logits and never communicates, so a scheme written in a notebook runs distributed unchanged:
``fmoe.moe`` does the dispatch and reduces any global statistics (see
:class:`fmoe.routing.global_stats.GlobalStat`). A ``Routing`` holds, per token, ``K`` global expert ids
and the weights their outputs are mixed with, plus ``aux`` (losses and statistics).

Extra inputs (token ids, the layer index, router state) are keyword arguments the router
declares: :mod:`fmoe.routing.inputs`.

Attributes a router may carry, read by the trainer's balancing flags
(:mod:`fmoe.training.balancing`): ``router.scores = "sigmoid"`` (the score function its balance
losses use; default softmax), and ``router.no_balance_loss = "why"`` for a router a balance loss
does not fit (expert choice: balanced by construction; hash / round-robin / random routing:
experts fixed whatever the scores): the trainer then defaults to no balancing and refuses
``--balance aux`` / ``seq_aux`` / ``global_aux`` with that reason.

**What ``aux`` may hold.** Every entry is a *loss* or a *statistic*, decided by its type:

- ``Loss(value)`` (:class:`Loss`): a term of the training loss, already weighted. ``value`` is a
  scalar tensor (computed on this rank's tokens; the layer averages it over the data-parallel
  batches) or a :class:`fmoe.routing.global_stats.GlobalStat` (a quantity of the global batch). The
  trainer adds it to the loss and logs it under its key.
- a tensor or a ``GlobalStat``: a statistic, logged (per layer; a tensor's value is averaged over
  the ranks, a ``GlobalStat`` is finished over all batches), never trained.

Anything else is a ``TypeError`` naming the key; so is a key the layer writes itself
(:data:`RESERVED`), and a bare tensor under a key ending in ``_loss`` (once the loss
convention: wrap it in :class:`Loss` to train it, or rename it to log it) — so no entry is
ever dropped silently. ``fmoe.moe`` returns the finished values (plain tensors) and records
which key is which in ``aux["router_keys"]`` (``{key: "loss" | "stat"}``).

A slot with weight exactly 0 contributes nothing to the output or to any gradient that
reaches the router (its weight is a constant). **Inactive slots**: a router that gives a token
fewer than ``K`` experts (ReLU routing, capacity dropping, expert choice) may mark the spare slots
with expert id ``-1`` (:data:`INACTIVE`) and weight exactly 0: the dispatch neither sends nor
computes them (every ``impl``: the expert ranks receive and run active slots only), and the
statistics count active slots only. A spare slot may also hold weight 0 and an id the token
already uses (computed, adding nothing), as the capacity routers do.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch

from .global_stats import GlobalStat, batch_mean
from ..transforms import data_checks_enabled

__all__ = ["Routing", "Router", "Loss", "RESERVED", "INACTIVE", "active", "validate", "check_aux", "as_stats",
           "check_k", "check_logits"]

#: aux keys ``fmoe.moe`` writes itself; a router may not use them.
RESERVED = ("load", "imbalance", "tokens_per_expert", "dispatch_rows", "router_keys", "computed_slots")

#: the expert id of an inactive slot (weight 0; neither sent nor computed).
INACTIVE = -1


def active(expert_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids with inactive slots as expert 0, active mask)``: for counts and scatters, whose
    inactive entries then add 0 through the mask.

    Example:
        >>> active(torch.tensor([[2, -1]]))
        (tensor([[2, 0]]), tensor([[ True, False]]))
    """
    on = expert_ids >= 0
    return torch.where(on, expert_ids, torch.zeros_like(expert_ids)), on


class Loss(NamedTuple):
    """Marks a router's aux entry as a term of the training loss (already weighted).

    Attributes:
        value: a scalar tensor (this rank's tokens; averaged over the data-parallel batches by
            ``fmoe.moe``) or a :class:`fmoe.routing.global_stats.GlobalStat` finishing to a scalar.

    Example:
        >>> logits = torch.zeros(2, 4, requires_grad=True)
        >>> sorted(Routing(torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long),
        ...                {"zz_penalty": Loss(logits.square().mean())}).aux)
        ['zz_penalty']
    """

    value: Any


class Routing(NamedTuple):
    """A routing decision for ``T`` tokens.

    Attributes:
        weights: ``[T, K]`` floating mixing weights (differentiable: gradients reach the router).
        expert_ids: ``[T, K]`` int64 global expert ids in ``[0, E)``, or ``-1`` for an inactive
            slot (weight 0: neither sent nor computed).
        aux: extra entries, each a loss (:class:`Loss`: trained and logged) or a statistic (a
            tensor, or a :class:`fmoe.routing.global_stats.GlobalStat` for a quantity over all
            data-parallel batches, which ``fmoe.moe`` reduces and finishes): logged.
    """

    weights: torch.Tensor
    expert_ids: torch.Tensor
    aux: dict


Router = Callable[..., Routing]


def check_k(k: int, name: str = "k") -> None:
    """``ValueError`` unless ``k`` is an int >= 1 (a factory argument)."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"router: {name} must be an int >= 1, got {name}={k!r}")


def check_logits(logits: torch.Tensor, k: int) -> None:
    """``ValueError`` unless ``logits`` is ``[T, E]`` with ``k <= E``."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"router: logits must be [T, E], got shape {shape}")
    if k > logits.shape[1]:
        raise ValueError(f"router: k={k} exceeds the number of experts E={logits.shape[1]}")


def check_aux(aux: object) -> dict:
    """``{key: "loss" | "stat"}`` of a router's aux, or a ``TypeError`` naming the entry that is
    neither (see the module docstring).

    Example:
        >>> check_aux({"p": Loss(torch.tensor(0.1)), "n": torch.tensor(3)})
        {'p': 'loss', 'n': 'stat'}
        >>> check_aux({"n": 3})
        Traceback (most recent call last):
        ...
        TypeError: router: aux['n'] is int; an aux entry is fmoe.routing.Loss(scalar tensor or GlobalStat) (trained and logged), or a tensor or GlobalStat (a statistic, logged)
    """
    if not isinstance(aux, dict):
        raise TypeError(f"router: aux must be a dict, got {type(aux).__name__}")
    kinds = {}
    for key, v in aux.items():
        if not isinstance(key, str):
            raise TypeError(f"router: aux keys must be strings, got {key!r}")
        if key in RESERVED:
            raise TypeError(f"router: aux[{key!r}]: the layer writes {', '.join(RESERVED)} itself; rename it")
        if isinstance(v, Loss):
            inner = v.value
            if isinstance(inner, torch.Tensor) and inner.ndim != 0:
                raise TypeError(f"router: aux[{key!r}] = Loss(tensor of shape {tuple(inner.shape)}): a loss is a "
                                "scalar")
            if not isinstance(inner, (torch.Tensor, GlobalStat)):
                raise TypeError(f"router: aux[{key!r}] = Loss({type(inner).__name__}): a loss is a scalar tensor or "
                                "a GlobalStat")
            kinds[key] = "loss"
        elif isinstance(v, (torch.Tensor, GlobalStat)):
            if key.endswith("_loss"):
                raise TypeError(f"router: aux[{key!r}] is a bare {type(v).__name__} named like a loss; wrap it in "
                                f"fmoe.routing.Loss(...) to train it, or rename it to log it as a statistic")
            kinds[key] = "stat"
        else:
            raise TypeError(f"router: aux[{key!r}] is {type(v).__name__}; an aux entry is fmoe.routing.Loss(scalar "
                            "tensor or GlobalStat) (trained and logged), or a tensor or GlobalStat (a statistic, "
                            "logged)")
    return kinds


def as_stats(aux: dict) -> tuple[dict, dict]:
    """``(stats, kinds)``: the aux with every :class:`Loss` unwrapped into a ``GlobalStat`` (a
    plain tensor loss becomes its mean over the data-parallel batches,
    :func:`fmoe.routing.global_stats.batch_mean`) for ``fmoe.moe`` to finalize, and :func:`check_aux`'s
    ``{key: "loss" | "stat"}``.

    Example:
        >>> stats, kinds = as_stats({"p": Loss(torch.tensor(0.5))})
        >>> stats["p"].local(), kinds
        (tensor(0.5000), {'p': 'loss'})
    """
    kinds = check_aux(aux)
    stats = {}
    for key, v in aux.items():
        if isinstance(v, Loss):
            v = v.value if isinstance(v.value, GlobalStat) else batch_mean(v.value)
        stats[key] = v
    return stats, kinds


def validate(routing: object, num_tokens: int, num_experts: int) -> Routing:
    """Check what a router returned; raise ``ValueError``/``TypeError`` naming the problem.

    Runs before any communication (one host sync for the id range and NaN check; that value
    check is skipped under ``vmap`` and ``torch.compile``, see :mod:`fmoe.transforms`).

    Args:
        routing: the router's return value.
        num_tokens: T, the number of tokens given to the router.
        num_experts: E.
    Returns:
        the routing, with ``expert_ids`` as int64.

    Example:
        >>> validate((torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.long), {}), 2, 4).expert_ids.dtype
        torch.int64
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
    check_aux(aux)
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
    if ids.numel() and data_checks_enabled():     # one host sync: eager only (fmoe.transforms)
        lo, hi, bad, weighted = torch.stack([ids.min().long(), ids.max().long(),
                                             (~torch.isfinite(w)).sum().long().to(ids.device),
                                             ((ids < 0) & (w != 0)).sum().long().to(ids.device)]).tolist()
        if lo < INACTIVE or hi >= num_experts:
            raise ValueError(f"router: expert_ids must be in [0, {num_experts}) or -1 (an inactive slot), got "
                             f"values in [{lo}, {hi}]")
        if bad:
            raise ValueError("router: weights contain NaN or inf")
        if weighted:
            raise ValueError(f"router: {weighted} inactive slot(s) (expert id -1) have a non-zero weight; an "
                             "inactive slot's weight must be 0")
    return Routing(w, ids.long(), aux)
