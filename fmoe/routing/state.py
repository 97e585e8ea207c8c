"""Router state: tensors a router reads, moved by a pure update after each optimizer step.

Some routers carry state that is not trained by gradients but updated from the step's global
statistics: the aux-loss-free expert bias (Wang et al. 2024: each expert's bias moves against its
load), ReMoE's L1 coefficient (Liu et al. 2025: raised while the routing is denser than the
target, lowered while it is sparser). One mechanism serves them all:

- a router declares ``router.state = RouterState(init, update)`` (:func:`with_state`);
  ``init(E) -> {name: tensor}`` gives one MoE layer's initial state, ``update(state, stats) ->
  state`` its next value from the step's statistics of that layer (pure, no collectives);
- the state lives in the parameter tree beside the layer's weights (``layers.3.moe.<name>``), so
  it is sharded, checkpointed, resumed bitwise and resharded like any leaf; what makes a leaf state
  is where it sits, not its name: every entry of an MoE layer that is not one of its
  :data:`WEIGHTS` (:func:`state_keys`, :func:`is_state`). State never receives a gradient (the
  job marks it so, the optimizer leaves it alone), keeps its fp32 master value under a bf16
  compute dtype, and a resume into a stateful router from a checkpoint without it starts it
  from the router's ``init`` (:mod:`fmoe.training.router_state`);
- ``fmoe.moe`` passes each state entry to the router as a keyword input of its name, detached
  (the router declares it: ``def router(logits, *, l1_coef): ...``);
- after each optimizer step the trainer (:mod:`fmoe.training.step`) calls :func:`update_layer` per
  MoE layer with ``stats``: ``load`` (``[E]`` routed slots per expert over the global batch and the
  step's micro-batches) and every statistic the router reports (its finished ``GlobalStat``\\ s,
  the same value on every rank, averaged over the micro-batches). The update must read only such
  global values, so that every rank computes the same state. The log row carries each state entry
  per layer (:func:`scalars`: a scalar under its name, a vector's largest magnitude as ``<name>_absmax``).

The expert bias is one such state (:func:`bias_state`: ``--balance bias --bias-rate U``).

Example (ReMoE's adaptive L1 coefficient, :func:`fmoe.routing.remoe`, in two lines)::

    grow = lambda s, stats: {"l1_coef": s["l1_coef"] * 1.2 ** torch.sign(stats["active"] - 2.0)}
    router = with_state(router, RouterState(lambda E: {"l1_coef": torch.tensor(1e-3)}, grow))
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

from ..sharding import placed_like, to_local

__all__ = ["RouterState", "WEIGHTS", "state_keys", "is_state", "with_state", "state_of", "bias_state", "init_layer",
           "update_layer", "scalars"]

#: The entries of an MoE layer's params (:func:`fmoe.moe`) that are its weights; every other is router state.
WEIGHTS = ("router", "router_bias", "shared", "w_gate_up", "w_down", "b_gate_up", "b_down")


def state_keys(moe: Mapping) -> list[str]:
    """The router-state entries of one MoE layer's params: every key that is not one of :data:`WEIGHTS`.

    Example:
        >>> state_keys({"router": 0, "w_gate_up": 0, "w_down": 0, "expert_bias": 0, "l1_coef": 0})
        ['expert_bias', 'l1_coef']
    """
    return [k for k in moe if k not in WEIGHTS]


def is_state(path: str) -> bool:
    """Whether the leaf at a model-tree ``path`` is router state (an entry of an MoE layer,
    ``...moe.<name>``, that is not one of its :data:`WEIGHTS`): no gradient, no optimizer
    update, kept in its master dtype.

    Example:
        >>> [is_state(p) for p in ("layers.0.moe.l1_coef", "layers.0.moe.router", "layers.0.moe.shared.w_down")]
        [True, False, False]
    """
    parts = path.split(".")
    return len(parts) >= 2 and parts[-2] == "moe" and parts[-1] not in WEIGHTS


class RouterState(NamedTuple):
    """What a stateful router declares (see the module docstring).

    Attributes:
        init: ``init(num_experts) -> {name: tensor}``, one MoE layer's initial state.
        update: ``update(state, stats) -> state`` after each optimizer step (same names, shapes and
            dtypes; pure; reads only global statistics such as ``stats["load"]``).
    """

    init: Callable[[int], dict]
    update: Callable[[dict, Mapping[str, torch.Tensor]], dict]


def with_state(router: Callable, state: RouterState) -> Callable:
    """``router`` carrying ``state`` (its ``state`` attribute; a router without attributes, e.g. a
    builtin, is wrapped).

    Example:
        >>> import fmoe
        >>> r = with_state(fmoe.routing.topk(1), bias_state(1e-3))
        >>> sorted(state_of(r).init(4))
        ['expert_bias']
    """
    if not isinstance(state, RouterState) or not (callable(state.init) and callable(state.update)):
        raise TypeError(f"with_state: state must be a RouterState(init, update) of callables, got {state!r}")
    try:
        router.state = state
        return router
    except AttributeError:
        def wrapped(logits, **inputs):
            return router(logits, **inputs)

        wrapped.state = state
        return wrapped


def state_of(router: Any) -> Optional[RouterState]:
    """The :class:`RouterState` a router declares (None: stateless).

    Example:
        >>> import fmoe
        >>> state_of(fmoe.routing.topk(2)) is None
        True
    """
    state = getattr(router, "state", None)
    if state is not None and not isinstance(state, RouterState):
        raise TypeError(f"router {getattr(router, '__name__', router)!r}: its state attribute must be a "
                        f"fmoe.routing.state.RouterState(init, update), got {type(state).__name__}")
    return state


def bias_state(rate: float, rule: str = "sign") -> RouterState:
    """The aux-loss-free expert bias as router state: ``expert_bias [E]`` (fp32 zeros), moved by
    :func:`fmoe.routing.update_bias` against the step's ``load`` (``rate`` 0: frozen).

    Example:
        >>> s = bias_state(0.1)
        >>> s.update(s.init(3), {"load": torch.tensor([5.0, 1.0, 0.0])})["expert_bias"]
        tensor([-0.1000,  0.1000,  0.1000])
    """
    from .bias import RULES, update_bias

    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
        raise ValueError(f"bias_state: rate must be a number >= 0, got {rate!r}")
    if rule not in RULES:
        raise ValueError(f"bias_state: rule must be one of {RULES}, got {rule!r}")

    def update(state: dict, stats: Mapping[str, torch.Tensor]) -> dict:
        return state if rate == 0 else {"expert_bias": update_bias(state["expert_bias"], stats["load"], rate, rule)}

    return RouterState(lambda E: {"expert_bias": torch.zeros(E)}, update)


def init_layer(moe: dict, state: RouterState) -> dict:
    """One MoE layer's params with the state's initial entries it lacks (on the router's device;
    an entry the layer holds already, e.g. a loaded ``expert_bias``, is kept).

    Example:
        >>> sorted(init_layer({"router": torch.zeros(4, 2)}, bias_state(1e-3)))
        ['expert_bias', 'router']
    """
    fresh = state.init(moe["router"].shape[0])
    if not isinstance(fresh, dict) or not all(isinstance(v, torch.Tensor) for v in fresh.values()):
        raise TypeError(f"router state: init(E) must return a dict of tensors, got {fresh!r}")
    return {**moe, **{k: v.to(moe["router"].device) for k, v in fresh.items() if k not in moe}}


def update_layer(state: RouterState, current: dict, stats: Mapping[str, torch.Tensor]) -> dict:
    """``state.update(current, stats)`` for one layer, no grad, each new entry checked (same shape
    and dtype) and placed like the old one (a sharded leaf stays sharded).

    Example:
        >>> update_layer(bias_state(1.0), {"expert_bias": torch.zeros(2)}, {"load": torch.tensor([3.0, 1.0])})
        {'expert_bias': tensor([-1.,  1.])}
    """
    with torch.no_grad():
        plain = {k: to_local(v).detach() if v.ndim == 0 else v.detach() for k, v in current.items()}
        new = state.update(plain, dict(stats))
    if not isinstance(new, dict) or set(new) != set(current):
        raise ValueError(f"router state: update returned {sorted(new) if isinstance(new, dict) else type(new).__name__}"
                         f", expected the entries {sorted(current)}")
    out = {}
    for k, v in new.items():
        old = current[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(old.shape) or v.dtype != old.dtype:
            got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"router state: update made {k!r} {got}, expected {tuple(old.shape)} {old.dtype}")
        out[k] = v if type(v) is type(old) else placed_like(to_local(v).detach(), old)
    return out


def scalars(name: str, value: torch.Tensor) -> tuple[str, float]:
    """A state entry's log-row key and number: a scalar under its name, anything else as its
    largest magnitude under ``<name>_absmax``.

    Example:
        >>> scalars("l1_coef", torch.tensor(0.5)), scalars("expert_bias", torch.tensor([0.1, -0.3]))
        (('l1_coef', 0.5), ('expert_bias_absmax', 0.30000001192092896))
    """
    value = value.detach()
    return (name, float(value)) if value.ndim == 0 else (f"{name}_absmax", float(value.abs().max()))
