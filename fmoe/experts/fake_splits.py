"""Split sizes on fake tensors: the rule the dry run and the memory plan share.

Under ``torch._subclasses.FakeTensorMode`` (``fmoe memory --dry-run``) tensors have shapes
but no values, so the two places where routing decides a size on the host cannot read it: the
dispatch's split-size exchange (rows and slots each expert rank receives) and the expert layer's
rows per local expert. Both then follow this rule instead, and the memory plan
(:mod:`fmoe.memory.peak`) counts with the same functions. It lives with the expert layer, the
lowest of its users (the dispatch in :mod:`fmoe.ep` imports the experts), so neither the
dispatch nor the experts import :mod:`fmoe.memory`:

- **spread**: every token's ``K`` routing slots land on ``min(K, ep)`` distinct expert ranks,
  spread evenly, so a dispatching rank sends ``ceil``-balanced ``T * min(K, ep) / ep`` rows to
  each rank of its expert group (the most rows a token can cost: the once-per-rank
  de-duplication saves nothing), carrying ``T * K / ep`` slots to each;
- **balanced experts**: the slots a rank receives are split evenly over its local experts;

A skewed router costs more than this on its hottest rank; the dry run does not model skew.

Remainders go to the lowest indices, so the numbers are integers and sum exactly.

Example:
    >>> [spread_rows(5, k=8, ep=4, dst=d) for d in range(4)]
    [5, 5, 5, 5]
    >>> even_counts(10, 4)
    [3, 3, 2, 2]
"""

from __future__ import annotations

import torch

__all__ = ["is_fake", "spread_rows", "spread_slots", "even_counts", "received"]


def is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake tensor (shape without data): host reads of it follow this rule."""
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    if torch.compiler.is_compiling():  # Dynamo's own fakes are real tensors to the traced code
        return False
    return bool(_is_fake(t))


def _share(total: int, n: int, i: int) -> int:
    base, extra = divmod(total, n)
    return base + (1 if i < extra else 0)


def spread_rows(tokens: int, *, k: int, ep: int, dst: int) -> int:
    """Rows a rank dispatching ``tokens`` tokens sends to expert rank ``dst`` (spread rule)."""
    return _share(tokens * min(k, ep), ep, dst)


def spread_slots(tokens: int, *, k: int, ep: int, dst: int) -> int:
    """Routing slots (token, expert) those rows carry to ``dst``."""
    return _share(tokens * k, ep, dst)


def even_counts(total: int, n: int) -> list[int]:
    """``total`` rows split over ``n`` experts, remainders first."""
    return [_share(total, n, i) for i in range(n)]


def received(slice_sizes: list[int], *, k: int, me: int) -> tuple[list[int], int]:
    """What expert rank ``me`` receives from each rank of its expert group, whose dispatching
    slices hold ``slice_sizes`` tokens: ``(rows from each rank, total slots)``.

    Example:
        >>> received([3, 3, 2, 2], k=2, me=0)
        ([2, 2, 1, 1], 6)
    """
    ep = len(slice_sizes)
    rows = [spread_rows(t, k=k, ep=ep, dst=me) for t in slice_sizes]
    slots = sum(spread_slots(t, k=k, ep=ep, dst=me) for t in slice_sizes)
    return rows, slots
