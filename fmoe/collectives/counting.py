"""Bytes sent by the collectives, measured where they run: ``with counting() as sent: ...``.

Every collective of this package reports, while a :func:`counting` block is active in the
calling context, the bytes this rank sends to the other ranks of its group, by kind. The sizes are
the tensors' own at run time (an all-to-all's split sizes are the router's decisions of this
step); what leaves the rank for a given payload is the standard ring accounting, which is what
gloo's and NCCL's ring algorithms send (``n`` ranks in the group, ``B`` the payload's bytes):

================  ===========================  ===================================
kind              payload ``B``                bytes sent
================  ===========================  ===================================
all_to_all        the rows for other ranks     ``B`` (exact: the own rows stay)
all_gather        this rank's piece            ``(n - 1) * B``
reduce_scatter    the whole buffer             ``(n - 1) / n * B``
all_reduce        the buffer                   ``2 * (n - 1) / n * B``
broadcast         the buffer (source rank)     ``(n - 1) * B`` on the source, 0 elsewhere
send              the tensor (pipeline stage)  ``B``
================  ===========================  ===================================

Object collectives (settings, checkpoint bookkeeping) and barriers are not counted, nor a
collective torch.compile traces (its functional collectives run inside the compiled graph).
The counter lives in a :class:`contextvars.ContextVar`, so nested or concurrent blocks (threads,
asyncio tasks) count apart, and no module holds the state. Backward runs in the calling thread on
CPU, so a step's backward collectives count in its block.

Example:
    >>> import torch
    >>> with counting() as sent:
    ...     count("all_gather", torch.ones(4), 3)
    >>> sent.by_kind, sent.total
    ({'all_gather': 32}, 32)
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Iterator, Optional

import torch

__all__ = ["SentBytes", "counting", "count", "count_bytes", "KINDS"]

#: kind -> bytes sent per payload byte, for a group of n ranks (the table above)
_SHARE = {"all_gather": lambda n: n - 1, "reduce_scatter": lambda n: (n - 1) / n,
          "all_reduce": lambda n: 2 * (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
          "broadcast": lambda n: n - 1, "send": lambda n: 1}
#: every kind a collective reports
KINDS = tuple(sorted(_SHARE))


@dataclasses.dataclass
class SentBytes:
    """Bytes this rank sent inside one :func:`counting` block, by collective kind."""

    by_kind: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        """Bytes sent, every kind together."""
        return sum(self.by_kind.values())


_ACTIVE: contextvars.ContextVar[Optional[SentBytes]] = contextvars.ContextVar("fmoe_sent_bytes", default=None)


@contextlib.contextmanager
def counting() -> Iterator[SentBytes]:
    """Count the bytes the collectives send inside the block (this context only).

    Returns:
        a :class:`SentBytes`, filled while the block runs.
    """
    sent = SentBytes()
    token = _ACTIVE.set(sent)
    try:
        yield sent
    finally:
        _ACTIVE.reset(token)


def count_bytes(kind: str, nbytes: float) -> None:
    """Add ``nbytes`` sent by a collective of ``kind`` to the active block (if any)."""
    if torch.compiler.is_compiling():            # first: traced code never reads the context
        return
    sent = _ACTIVE.get()
    if sent is not None:
        sent.by_kind[kind] = sent.by_kind.get(kind, 0) + int(round(nbytes))


def count(kind: str, payload: torch.Tensor, n: int) -> None:
    """Count a collective of ``kind`` over ``n`` ranks whose payload is ``payload`` (the table)."""
    if n > 1 and not torch.compiler.is_compiling() and _ACTIVE.get() is not None:
        count_bytes(kind, payload.numel() * payload.element_size() * _SHARE[kind](n))
