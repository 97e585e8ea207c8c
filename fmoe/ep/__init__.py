"""Expert parallelism: how routed tokens reach the experts and come back.

An implementation is a documented pair of steps, an :class:`ExpertParallel` (the contract, with
what a :class:`Dispatch` returns, is in :mod:`fmoe.ep.contract`)::

    d = impl.dispatch(x, weights, expert_ids, experts, mesh, stats)   # tokens -> rows on expert ranks
    out = experts.weighted_sum_per_row(d.rows, d.weights, d.local_ids, d.num_slots)
    y = impl.combine(out, d, mesh)                                    # expert outputs -> tokens

or a whole-layer function ``fn(x, weights, expert_ids, experts, mesh) -> y | (y, extra)``.
Register either with :func:`register` and select it by name in ``fmoe.moe(..., impl=name)``;
``fmoe.moe`` runs every implementation through :func:`run`, built-in or not.

Built in (each an :class:`ExpertParallel`, also callable as a whole-layer function):

==============  ========================  =================================================
name            object                    what moves
==============  ========================  =================================================
``local``       ``LOCAL`` / ``local``      nothing (one process, or ``ep == 1``)
``all_reduce``  ``ALL_REDUCE`` /           nothing; partial outputs summed (``ep == tp``),
                ``all_reduce_impl``        :mod:`fmoe.ep.masked`
``all_to_all``  ``ALL_TO_ALL`` /           each token once per expert rank, one weighted row
                ``all_to_all_impl``        back; statistics folded, :mod:`fmoe.ep.token_dispatch`
==============  ========================  =================================================

Gradient semantics after each rank calls ``backward()`` on a loss of its own output: ``x`` and
the router get the gradient of the rank's own batch (TP ranks share a batch and all get the
full-batch gradient); each local expert gets the sum over the distinct batches of its EP group
(``ep / tp`` batches) of that batch's gradient, every token counted once.
"""

from __future__ import annotations

from ..experts import BLOCKED_MIN_ROWS, LocalExperts, sorted_by_expert
from .contract import Dispatch, ExpertParallel, Impl, Result, as_function, run, takes_stats
from .masked import ALL_REDUCE, LOCAL
from .token_dispatch import ALL_TO_ALL, folds_stats, pack_ids, tp_slice_bounds, unpack_ids

__all__ = ["Dispatch", "ExpertParallel", "Result", "run", "takes_stats", "as_function", "LOCAL", "ALL_REDUCE",
           "ALL_TO_ALL", "local", "all_reduce_impl", "all_to_all_impl", "register", "get", "registered",
           "folds_stats", "pack_ids", "unpack_ids", "tp_slice_bounds", "LocalExperts", "BLOCKED_MIN_ROWS",
           "sorted_by_expert"]

local = LOCAL                    # the built-ins under their former names (callable as functions)
all_reduce_impl = ALL_REDUCE
all_to_all_impl = ALL_TO_ALL

_REGISTRY: dict[str, Impl] = {}


def register(name: str, impl: Impl) -> Impl:
    """Make ``impl`` (an :class:`ExpertParallel` pair or a whole-layer function, see the module
    docstring) selectable as ``fmoe.moe(..., impl=name)``. Returns ``impl``.

    Args:
        name: any non-empty string but ``"auto"``; a built-in's name replaces the built-in.
        impl: the implementation.
    Returns:
        ``impl``.

    Example:
        >>> register("my_local", LOCAL) is LOCAL
        True
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"ep.register: name must be a non-empty string other than 'auto', got {name!r}")
    if not isinstance(impl, ExpertParallel) and not callable(impl):
        raise TypeError(f"ep.register: impl must be an fmoe.ep.ExpertParallel pair or a callable "
                        f"fn(x, weights, expert_ids, experts, mesh), got {type(impl).__name__}")
    _REGISTRY[name] = impl
    return impl


def registered() -> list[str]:
    """Names usable as ``impl`` (plus ``"auto"``)."""
    return sorted(_REGISTRY)


def get(name: str) -> Impl:
    """The implementation registered as ``name``; ``ValueError`` listing the known names."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown MoE impl {name!r}; registered: {['auto'] + registered()}")
    return _REGISTRY[name]


register("all_to_all", ALL_TO_ALL)
register("all_reduce", ALL_REDUCE)
register("local", LOCAL)
