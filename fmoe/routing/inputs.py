"""How a router receives inputs besides the logits: keyword arguments it declares.

Extra inputs are keyword arguments. A router that needs more than the logits declares them::

    def router(logits, *, token_ids): ...          # hash routing
    def router(logits, *, layer, token_ids): ...   # a per-layer hash
    def router(logits, *, expert_bias=None): ...   # aux-loss-free balancing

Every model offers every router the inputs named in :data:`OFFERED`: ``token_ids [T]`` (the
ids of the very rows the router scores: this rank's piece of the sequence under sequence
parallelism, a pipeline stage's tokens) and ``layer`` (the decoder layer's index, an int). An
offered input reaches a router only when it declares it (by name, or with ``**inputs``), so
``router(logits)`` keeps working. ``fmoe.moe`` also passes the router's state (every entry of
its params that is not a weight, e.g. ``expert_bias``, detached: :mod:`fmoe.routing.state`) and
every entry of its ``router_inputs=`` mapping;
:func:`call` checks that the router accepts those (or takes ``**inputs``) before calling it. What
a router declares is read from its signature once per trace (:func:`accepted`:
``torch.compiler.assume_constant_result``, so the choice costs nothing under ``torch.compile``
and works under ``vmap``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

__all__ = ["OFFERED", "accepted", "call"]

#: inputs every model offers its routers (``fmoe.moe(..., router_inputs=)`` from the decoder
#: scaffold): passed only to a router that declares them; any other input must be accepted.
OFFERED = ("token_ids", "layer")


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
