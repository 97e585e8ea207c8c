"""Expert parallelism: how routed tokens reach the experts and come back.

An implementation is a documented pair of steps, an :class:`ExpertParallel` (the contract, with
what a :class:`Dispatch` returns, is in :mod:`fmoe.ep.contract`)::

    d = impl.dispatch(x, weights, expert_ids, experts, mesh, stats)   # tokens -> rows on expert ranks
    out = experts.weighted_sum_per_row(d.rows, d.weights, d.local_ids, d.num_slots)
    y = impl.combine(out, d, mesh)                                    # expert outputs -> tokens

or a whole-layer function ``fn(x, weights, expert_ids, experts, mesh) -> y | (y, extra)``.
Register either with :func:`register` and select it by name in ``fmoe.moe(..., impl=name)``;
``fmoe.moe`` runs every implementation through :func:`run`, built-in or not. What ``fmoe.moe``
needs to know about a name is declared with it (:class:`Declared`: the meshes it serves, what
runs instead on one rank), so the layer chooses by those properties, never by the name; a
name registered again gets the properties given with it (none by default: it runs as given).
``impl="auto"`` is the name :func:`auto` returns for the mesh.

Built in (each an :class:`ExpertParallel`, also callable as a whole-layer function):

==============  ==============  =================================================
name            object          what moves
==============  ==============  =================================================
``local``       ``LOCAL``       nothing (one process, or ``ep == 1``)
``all_reduce``  ``ALL_REDUCE``  nothing; partial outputs summed; declared
                                ``shared_batch`` (``ep == tp``), ``one_rank="local"``,
                                :mod:`fmoe.ep.masked`
``all_to_all``  ``ALL_TO_ALL``  each token once per expert rank, one weighted row
                                back; statistics folded; declared ``one_rank="local"``,
                                :mod:`fmoe.ep.token_dispatch`
==============  ==============  =================================================

Gradient semantics after each rank calls ``backward()`` on a loss of its own output: ``x`` and
the router get the gradient of the rank's own batch (TP ranks share a batch and all get the
full-batch gradient); each local expert gets the sum over the distinct batches of its EP group
(``ep / tp`` batches) of that batch's gradient, every token counted once.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

from ..experts import BLOCKED_MIN_ROWS, LocalExperts, sorted_by_expert
from .contract import Dispatch, ExpertParallel, Impl, Result, as_function, run, takes_stats
from .masked import ALL_REDUCE, LOCAL
from .token_dispatch import ALL_TO_ALL, folds_stats, pack_ids, tp_slice_bounds, unpack_ids

__all__ = ["Dispatch", "ExpertParallel", "Result", "run", "takes_stats", "as_function", "LOCAL", "ALL_REDUCE",
           "ALL_TO_ALL", "register", "get", "registered", "Declared", "declared", "auto",
           "folds_stats", "pack_ids", "unpack_ids", "tp_slice_bounds", "LocalExperts", "BLOCKED_MIN_ROWS",
           "sorted_by_expert"]


class Declared(NamedTuple):
    """A registered implementation and what the registry declares about it (``fmoe.moe``
    chooses through these properties, never by the name).

    Attributes:
        impl: the implementation.
        shared_batch: it serves only meshes whose expert group shares one batch (``ep == tp``
            or one rank), as a masked all-reduce of partial outputs needs.
        one_rank: the registered name that runs instead when ``ep == 1`` (an equivalent that
            moves nothing), or None: this implementation runs on every mesh.
    """

    impl: Impl
    shared_batch: bool = False
    one_rank: Optional[str] = None

    @property
    def properties(self) -> dict:
        """The declared properties as :func:`register` keywords (to register a wrapper alike).

        Example:
            >>> declared("all_to_all").properties
            {'shared_batch': False, 'one_rank': 'local'}
        """
        return {"shared_batch": self.shared_batch, "one_rank": self.one_rank}


_REGISTRY: dict[str, Declared] = {}


def register(name: str, impl: Impl, *, shared_batch: bool = False, one_rank: Optional[str] = None) -> Impl:
    """Make ``impl`` (an :class:`ExpertParallel` pair or a whole-layer function, see the module
    docstring) selectable as ``fmoe.moe(..., impl=name)``, with its declared properties
    (:class:`Declared`). Returns ``impl``.

    Args:
        name: any non-empty string but ``"auto"``; a built-in's name replaces the built-in
            (and its properties: pass ``**declared(name).properties`` to keep them).
        impl: the implementation.
        shared_batch: serves only ``ep == tp`` meshes (``fmoe.moe`` refuses others).
        one_rank: a registered name to run instead when ``ep == 1``, or None.
    Returns:
        ``impl``.

    Example:
        >>> register("my_local", LOCAL) is LOCAL
        True
        >>> declared("my_local").one_rank is None
        True
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"ep.register: name must be a non-empty string other than 'auto', got {name!r}")
    if not isinstance(impl, ExpertParallel) and not callable(impl):
        raise TypeError(f"ep.register: impl must be an fmoe.ep.ExpertParallel pair or a callable "
                        f"fn(x, weights, expert_ids, experts, mesh), got {type(impl).__name__}")
    if not isinstance(shared_batch, bool):
        raise TypeError(f"ep.register: shared_batch must be a bool, got {type(shared_batch).__name__}")
    if one_rank is not None and one_rank not in _REGISTRY:
        raise ValueError(f"ep.register: one_rank={one_rank!r} is not a registered name; registered: {registered()}")
    _REGISTRY[name] = Declared(impl, shared_batch, one_rank)
    return impl


def registered() -> list[str]:
    """Names usable as ``impl`` (plus ``"auto"``)."""
    return sorted(_REGISTRY)


def declared(name: str) -> Declared:
    """The implementation registered as ``name`` with its properties; ``ValueError`` listing the
    known names.

    Example:
        >>> declared("all_reduce").shared_batch
        True
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown MoE impl {name!r}; registered: {['auto'] + registered()}")
    return _REGISTRY[name]


def get(name: str) -> Impl:
    """The implementation registered as ``name``; ``ValueError`` listing the known names."""
    return declared(name).impl


def auto(mesh, needs_grad: bool) -> str:
    """The name ``impl="auto"`` runs: ``"local"`` on one rank (``mesh`` None or ``ep == 1``);
    ``"all_reduce"`` when the expert group shares one batch (``ep == tp``, no ``sp``) and no gradient is
    needed (decoding: no host sync, no split sizes); ``"all_to_all"`` otherwise (training).
    Whatever is registered under the name runs.

    Example:
        >>> auto(None, needs_grad=True)
        'local'
    """
    if mesh is None or mesh.ep == 1:
        return "local"
    return "all_reduce" if mesh.ep == mesh.tp and not mesh.sp and not needs_grad else "all_to_all"


register("local", LOCAL)
register("all_to_all", ALL_TO_ALL, one_rank="local")
register("all_reduce", ALL_REDUCE, shared_batch=True, one_rank="local")
