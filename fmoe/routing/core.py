"""The router contract: ``Routing``, its validation, and how a router receives extra inputs.

A router is any callable ``router(logits[T, E]) -> Routing``. It sees only this rank's token
logits and never communicates, so a scheme written in a notebook runs distributed unchanged:
``fmoe.moe`` does the dispatch and reduces any global statistics (see
:class:`fmoe.routing.global_stats.GlobalStat`). A ``Routing`` holds, per token, ``K`` global expert ids
and the weights their outputs are mixed with, plus ``aux`` (losses and statistics).

Extra inputs are keyword arguments. A router that needs more than the logits declares them::

    def router(logits, *, token_ids): ...          # hash routing
    def router(logits, *, layer, token_ids): ...   # a per-layer hash
    def router(logits, *, expert_bias=None): ...   # aux-loss-free balancing

Every model offers every router the inputs named in :data:`OFFERED`: ``token_ids [T]`` (the
ids of the very rows the router scores: this rank's piece of the sequence under sequence
parallelism, a pipeline stage's tokens) and ``layer`` (the decoder layer's index, an int). An
offered input reaches a router only when it declares it (by name, or with ``**inputs``), so
``router(logits)`` keeps working. ``fmoe.moe`` also passes ``expert_bias`` when its params hold
one (detached: it never receives a gradient) and every entry of its ``router_inputs=`` mapping;
:func:`call` checks that the router accepts those (or takes ``**inputs``) before calling it. What
a router declares is read from its signature once per trace (:func:`accepted`:
``torch.compiler.assume_constant_result``, so the choice costs nothing under ``torch.compile``
and works under ``vmap``).

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
reaches the router (its weight is a constant), so routers that give a token fewer than ``K``
experts (capacity dropping, expert choice) fill the spare slots with weight 0 and an expert id
the token already uses: every id stays in ``[0, E)`` and no extra token is sent.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, NamedTuple

import torch

from .global_stats import GlobalStat, batch_mean
from ..transforms import data_checks_enabled

__all__ = ["Routing", "Router", "Loss", "RESERVED", "OFFERED", "validate", "check_aux", "as_stats", "call", "accepted",
           "check_k", "check_logits"]

#: aux keys ``fmoe.moe`` writes itself; a router may not use them.
RESERVED = ("load", "imbalance", "tokens_per_expert", "dispatch_rows", "router_keys")

#: inputs every model offers its routers (``fmoe.moe(..., router_inputs=)`` from the decoder
#: scaffold): passed only to a router that declares them; any other input must be accepted.
OFFERED = ("token_ids", "layer")


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
        expert_ids: ``[T, K]`` int64 global expert ids in ``[0, E)``.
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


@torch.compiler.assume_constant_result
def accepted(router: Callable) -> tuple[bool, tuple, tuple]:
    """``(takes **inputs, keyword names it accepts, keyword-only names it requires)`` of a router,
    read from its signature (a constant while Dynamo traces: the router is one object per trace).

    Example:
        >>> accepted(lambda logits, *, token_ids, layer=0: None)
        (False, ('layer', 'token_ids'), ('token_ids',))
    """
    try:
        sig = inspect.signature(router)
    except (TypeError, ValueError):       # builtins without a signature: assume anything goes
        return True, (), ()
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    names = {p.name for p in params[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    required = {p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty}
    return var_kw, tuple(sorted(names)), tuple(sorted(required))


def call(router: Callable, logits: torch.Tensor, inputs: Mapping[str, Any] | None = None) -> Any:
    """Call ``router(logits, **inputs)``: the :data:`OFFERED` inputs only if the router declares
    them, every other input after checking that the router takes it.

    Args:
        router: the router.
        logits: ``[T, E]``.
        inputs: extra keyword inputs (e.g. ``{"token_ids": ids, "layer": 3}``); None or empty:
            ``router(logits)``.
    Returns:
        whatever the router returns (``fmoe.moe`` validates it).

    Example:
        >>> def r(logits, *, token_ids):
        ...     return token_ids
        >>> call(r, torch.zeros(2, 4), {"token_ids": 7, "layer": 0})       # layer: offered, not declared
        7
    """
    var_kw, names, required = accepted(router)
    given = dict(inputs or {})
    inputs = {k: v for k, v in given.items() if var_kw or k in names or k not in OFFERED}
    missing = sorted(set(required) - set(inputs))
    if missing:
        offered = [k for k in missing if k in OFFERED]
        how = (f"{offered} are offered by every fmoe.model decoder; called directly, pass them with "
               if offered else "pass them with ")
        raise ValueError(f"router {getattr(router, '__name__', router)!r} needs keyword input(s) "
                         f"{missing}; {how}fmoe.moe(..., router_inputs={{...}})")
    if not var_kw:
        unknown = sorted(set(inputs) - set(names))
        if unknown:
            raise ValueError(f"router {getattr(router, '__name__', router)!r} does not accept "
                             f"keyword input(s) {unknown} (it accepts {sorted(names)}); declare "
                             f"them, e.g. def router(logits, *, {unknown[0]}): ..., or drop them "
                             f"(expert_bias comes from params['expert_bias'])")
    return router(logits, **inputs)


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
        lo, hi, bad = torch.stack([ids.min().long(), ids.max().long(),
                                   (~torch.isfinite(w)).sum().long().to(ids.device)]).tolist()
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"router: expert_ids must be in [0, {num_experts}), got values in [{lo}, {hi}]")
        if bad:
            raise ValueError("router: weights contain NaN or inf")
    return Routing(w, ids.long(), aux)
