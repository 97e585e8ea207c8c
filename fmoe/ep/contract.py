"""The expert-parallel contract: what an implementation is, what it returns, and how it is run.

An implementation is a pair of steps (torchtitan's ``_token_dispatch`` / ``_token_combine``), an
:class:`ExpertParallel`::

    d = impl.dispatch(x[T, D], weights[T, K], expert_ids[T, K], experts, mesh, stats) -> Dispatch
    out = experts.weighted_sum_per_row(d.rows, d.weights, d.local_ids, d.num_slots)   # [N, D]
    y = impl.combine(out, d, mesh)                                                    # [T, D]

:func:`run` is exactly these three lines; ``fmoe.moe`` calls it for the built-ins and for user
implementations alike. Besides the rows, a :class:`Dispatch` reports ``sent_rows`` (rows sent
to other ranks: ``aux["dispatch_rows"]``) and, when ``impl.folds_stats(mesh)``, ``stats_sum``:
``fmoe.moe`` then hands the dispatch the layer's packed routing statistics (``stats``, fp64
``[S]``, :func:`fmoe.routing.global_stats.pack`) and the dispatch returns their sum over this rank's
``fsdp`` group (differentiable, backward: identity), so the layer needs no all-reduce for them.

A whole-layer function ``fn(x, weights, expert_ids, experts, mesh) -> y`` (or ``(y, extra)``:
``extra`` merged into the aux, ``extra["dispatch_rows"]`` its row count) is the other accepted
form: :func:`run` calls it and reads ``extra``. A pair is also callable as such a function, so
code that wraps ``fmoe.ep.get(name)`` in its own function keeps working.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import torch

from ..experts import LocalExperts

__all__ = ["Dispatch", "ExpertParallel", "Result", "Impl", "run", "takes_stats", "as_function"]


class Dispatch(NamedTuple):
    """What a dispatch step returns: rows for this rank's experts and what its combine needs.

    Attributes:
        rows: ``[N, D]`` rows on this rank.
        weights: ``[N, K]`` routing weight per slot.
        local_ids: ``[N, K]`` local expert per slot, ``-1``: the slot's expert is elsewhere.
        sent_rows: ``()`` int64, rows sent to other ranks (0 when no tokens move).
        stats_sum: the packed statistics summed over the ``fsdp`` group, or None (see module).
        num_slots: slots with ``local_ids >= 0`` when known on the host, else None (spares the
            experts a host sync under ``torch.compile``).
        state: anything the implementation's own combine needs.
    """

    rows: torch.Tensor
    weights: torch.Tensor
    local_ids: torch.Tensor
    sent_rows: torch.Tensor
    stats_sum: Optional[torch.Tensor] = None
    num_slots: Optional[int] = None
    state: Any = None


def _never(mesh) -> bool:
    return False


class ExpertParallel(NamedTuple):
    """An expert-parallel implementation as a pair of steps (see the module docstring).

    Attributes:
        dispatch: ``dispatch(x, weights, expert_ids, experts, mesh, stats) -> Dispatch``.
        combine: ``combine(out [N, D], dispatch, mesh) -> y [T, D]``.
        folds_stats: ``folds_stats(mesh) -> bool``: whether ``dispatch`` sums ``stats``.

    Example:
        >>> ex = LocalExperts({"w_gate_up": torch.randn(2, 6, 4), "w_down": torch.randn(2, 4, 3)}, 0, 2)
        >>> same = ExpertParallel(lambda x, w, ids, ex, mesh, stats: Dispatch(x, w, ids - ex.first, torch.tensor(0)),
        ...                       lambda out, d, mesh: out)
        >>> y, extra = same(torch.randn(3, 4), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), ex, None)
        >>> y.shape, int(extra["dispatch_rows"])
        (torch.Size([3, 4]), 0)
    """

    dispatch: Callable[..., Dispatch]
    combine: Callable[..., torch.Tensor]
    folds_stats: Callable[[Any], bool] = _never

    def __call__(self, x, weights, expert_ids, experts: LocalExperts, mesh):
        """The pair as a whole-layer function: ``(y, {"dispatch_rows": n})``."""
        r = run(self, x, weights, expert_ids, experts, mesh)
        return r.y, {"dispatch_rows": r.sent_rows}


class Result(NamedTuple):
    """What :func:`run` gives ``fmoe.moe`` for any implementation."""

    y: torch.Tensor                    # [T, D]
    sent_rows: torch.Tensor            # () int64
    stats_sum: Optional[torch.Tensor]  # see Dispatch
    extra: dict                        # further aux entries (whole-layer functions only)


Impl = Union[ExpertParallel, Callable]


def run(impl: Impl, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, experts: LocalExperts,
        mesh, stats: Optional[torch.Tensor] = None) -> Result:
    """Run an implementation (a pair or a whole-layer function) on this rank's tokens.

    Args:
        impl: an :class:`ExpertParallel` or ``fn(x, weights, expert_ids, experts, mesh)``.
        x: ``[T, D]``; weights: ``[T, K]``; expert_ids: ``[T, K]`` global ids.
        experts: this rank's :class:`fmoe.experts.LocalExperts`.
        mesh: the :class:`fmoe.Mesh` (None in one process).
        stats: the packed statistics, only when :func:`takes_stats`.
    Returns:
        a :class:`Result`.

    Example:
        >>> from fmoe.ep import LOCAL
        >>> ex = LocalExperts({"w_gate_up": torch.randn(2, 6, 4), "w_down": torch.randn(2, 4, 3)}, 0, 2)
        >>> run(LOCAL, torch.randn(3, 4), torch.ones(3, 1), torch.zeros(3, 1, dtype=torch.long), ex, None).y.shape
        torch.Size([3, 4])
    """
    if isinstance(impl, ExpertParallel):
        d = impl.dispatch(x, weights, expert_ids, experts, mesh, stats)
        out = experts.weighted_sum_per_row(d.rows, d.weights, d.local_ids, d.num_slots)   # [N, D]
        return Result(impl.combine(out, d, mesh), d.sent_rows, d.stats_sum, {})
    out = impl(x, weights, expert_ids, experts, mesh)
    y, extra = out if isinstance(out, tuple) else (out, {})
    extra = dict(extra)
    sent = extra.pop("dispatch_rows", None)
    return Result(y, torch.tensor(0) if sent is None else sent, None, extra)


def takes_stats(impl: Impl, mesh) -> bool:
    """Whether :func:`run` takes the layer's packed statistics for ``impl`` on ``mesh``: a pair
    whose ``folds_stats(mesh)`` is true (a whole-layer function never does)."""
    return isinstance(impl, ExpertParallel) and bool(impl.folds_stats(mesh))


def as_function(impl: ExpertParallel) -> Callable:
    """The pair as a plain whole-layer function ``fn(x, weights, expert_ids, experts, mesh) ->
    (y, {"dispatch_rows": n})`` (it never folds statistics), e.g. to wrap in your own function.

    Example:
        >>> from fmoe.ep import LOCAL
        >>> callable(as_function(LOCAL))
        True
    """

    def fn(x, weights, expert_ids, experts: LocalExperts, mesh):
        return impl(x, weights, expert_ids, experts, mesh)

    return fn
