"""Routers named by text: ``NAME[:k=v,...]`` or ``module:function[:k=v,...]``.

The form the command line (``--router``), a checkpoint's ``meta.json`` and ``fmoe.generate``
use to name a router:

- ``NAME[:k=v,...]``: a built-in factory of :mod:`fmoe.routing` (one of :data:`ROUTERS`) called
  with the keyword arguments, values read as Python literals (a bare word is a string):
  ``sigmoid_topk:k=2,scale=2.5``, ``expert_choice:capacity_factor=2.0``.
- ``module:function[:k=v,...]``: your own code in an importable module. ``function`` is the
  router itself when it takes the logits (a required first positional argument,
  ``def my_router(logits): ...``) and no ``k=v`` follow; otherwise it is a factory, called
  with the ``k=v`` arguments (none: called with none), that returns the router.

Keys are checked against the factory's signature before it is called: an unknown key is an
error listing the keys it takes.

Example:
    >>> r = from_spec("topk:k=2,normalize=False")
    >>> r(torch.tensor([[0.0, 1.0, 3.0]])).expert_ids.tolist()
    [[2, 1]]
    >>> parse_spec("my.routers:noisy:scale=0.5")
    ('my.routers', 'noisy', {'scale': 0.5})
"""

from __future__ import annotations

import ast
import importlib
import inspect
from typing import Callable, Optional

import torch  # noqa: F401  (the doctest's tensors)

from .bias import sigmoid_topk
from .capacity import expert_choice, switch
from .fixed import balanced, hash_router, random_topk
from .record import replay
from .relu import remoe
from .topk import group_topk, topk, topk_softmax

__all__ = ["ROUTERS", "parse_spec", "from_spec"]

_FACTORIES = {f.__name__: f for f in (topk, topk_softmax, group_topk, sigmoid_topk, switch, expert_choice,
                                      hash_router, balanced, random_topk, replay, remoe)}
#: The built-in router factories of :mod:`fmoe.routing` a spec may name (routers only: not the
#: helper modules ``aux_losses`` / ``balance`` nor functions such as ``update_bias``).
ROUTERS = tuple(_FACTORIES)


def parse_spec(spec: str, what: str = "router") -> tuple[str, str, dict]:
    """``(module or "fmoe.routing", function, kwargs)`` of a router spec.

    Args:
        spec: ``NAME[:k=v,...]`` or ``module:function[:k=v,...]``.
        what: how errors name the spec (e.g. ``"--router"``).
    Returns:
        the module to import from, the function's name and its keyword arguments.
    Raises:
        ValueError: an empty spec or an item that is not ``key=value``.

    Example:
        >>> parse_spec("sigmoid_topk:k=2")
        ('fmoe.routing', 'sigmoid_topk', {'k': 2})
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what}: expected NAME[:k=v,...] or module:function[:k=v,...], got {spec!r}")
    parts = spec.split(":")
    if len(parts) >= 2 and "=" not in parts[1] and parts[1]:
        module, name, rest = parts[0], parts[1], ":".join(parts[2:])
    else:
        module, name, rest = "fmoe.routing", parts[0], ":".join(parts[1:])
    kwargs = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"{what} {spec!r}: {item!r} is not key=value")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value                      # a bare word: a string
    return module, name, kwargs


def _signature(fn: Callable) -> Optional[inspect.Signature]:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):                  # builtins without one: anything goes
        return None


def _takes_logits(fn: Callable) -> bool:
    """Does ``fn`` require a positional argument (a router's logits) rather than being a
    factory callable with none?"""
    sig = _signature(fn)
    return sig is not None and any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
                                   for p in sig.parameters.values())


def _check_keys(fn: Callable, kwargs: dict, label: str, what: str, spec: str) -> None:
    """``ValueError`` naming an unknown key and the keys ``fn`` takes."""
    sig = _signature(fn)
    if sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        return
    valid = [n for n, p in sig.parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in kwargs if k not in valid]
    if unknown:
        raise ValueError(f"{what} {spec!r}: unexpected keyword argument {unknown[0]!r}; {label} takes "
                         f"{', '.join(valid) or 'no arguments'}")


def from_spec(spec: str, what: str = "router") -> Callable:
    """The router a spec names (see the module docstring).

    Args:
        spec: ``NAME[:k=v,...]`` or ``module:function[:k=v,...]``.
        what: how errors name the spec (the CLI passes ``"--router"``).
    Returns:
        the router (a callable ``router(logits, **inputs) -> Routing``).
    Raises:
        ValueError: an unknown built-in name (listing :data:`ROUTERS`), a module or function
            that cannot be imported, an unknown key (listing the valid ones), or a factory that
            rejects its arguments.

    Example:
        >>> from_spec("expert_choice:cf=2")
        Traceback (most recent call last):
        ...
        ValueError: router 'expert_choice:cf=2': unexpected keyword argument 'cf'; expert_choice takes capacity_factor, k, max_experts
    """
    module, name, kwargs = parse_spec(spec, what)
    if module == "fmoe.routing":
        if name not in ROUTERS:
            raise ValueError(f"{what} {spec!r}: {name!r} is not a built-in scheme; choose from "
                             f"{', '.join(ROUTERS)}, or give module:function")
        factory = _FACTORIES[name]
    else:
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{what} {spec!r}: cannot import {name!r} from {module!r} ({e})") from None
        if not callable(factory):
            raise ValueError(f"{what} {spec!r}: {module}.{name} is not callable")
        if not kwargs and _takes_logits(factory):
            return factory                           # the user's router itself
    _check_keys(factory, kwargs, name, what, spec)
    if factory is replay and "resolve" not in kwargs:
        kwargs["resolve"] = from_spec            # a replayed record's own router is rebuilt from its spec
    try:
        return factory(**kwargs)
    except TypeError as e:
        raise ValueError(f"{what} {spec!r}: {e}") from None
