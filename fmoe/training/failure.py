"""The first failing rank, named once, for ranks another launcher started (torchrun's nodes).

When one rank fails, its peers fail soon after in their next collective with gloo's echo of it
("Connection closed by peer"), which names no rank. :func:`annotate` sorts a rank's error into
the two: a rank's own error (primary) is recorded in the job's rendezvous store, first writer
wins (``compare_set``), as ``rank R (node N): message``; an echo (secondary) waits briefly for
that record and becomes a :class:`PeerFailed` naming the first failing rank and node, or saying
that a peer ended without reporting (killed, or its node lost). The program prints a
:class:`PeerFailed` once per node (local rank 0), and not at all on the node of the rank that
failed first (which prints its own error).
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch.distributed as dist

from ..launch.caller import _SECONDARY

__all__ = ["PeerFailed", "annotate", "is_echo", "KEY"]

KEY = "fmoe/first_failure"     # the store key of the first failure


class PeerFailed(RuntimeError):
    """This rank stopped because another rank failed first (``first``: that rank's record, or None
    when no rank reported: killed, or its node lost); ``same_node``: the first failure is on this
    node (whose failing rank prints it)."""

    def __init__(self, message: str, first: Optional[str], same_node: bool):
        super().__init__(message)
        self.first, self.same_node = first, same_node


def is_echo(e: BaseException) -> bool:
    """Whether ``e`` is a collective's echo of another rank's failure (a closed or reset connection)."""
    return any(m in str(e) for m in _SECONDARY)


def _store():
    try:
        return dist.distributed_c10d._get_default_store() if dist.is_initialized() else None
    except (RuntimeError, ValueError):
        return None


def _node() -> str:
    return os.environ.get("GROUP_RANK", "0")


def annotate(e: BaseException, rank: int, wait: float = 2.0) -> BaseException:
    """The error a rank of a launcher-started job ends with (module docstring).

    Args:
        e: the rank's error.
        rank: this rank.
        wait: seconds an echo waits for the first failure's record.
    Returns:
        ``e`` itself for a primary error (recorded first), else a :class:`PeerFailed` (``e`` as its
        cause is left to the caller).
    """
    store = _store()
    if not is_echo(e):
        if store is not None:
            try:
                store.compare_set(KEY, "", f"rank {rank} (node {_node()}): {type(e).__name__}: {e}")
            except Exception:  # noqa: BLE001 - the store may be gone with its node
                pass
        return e
    first = None
    end = time.monotonic() + wait
    while store is not None and first is None and time.monotonic() < end:
        try:
            if store.check([KEY]):
                first = store.get(KEY).decode() or None
        except Exception:  # noqa: BLE001
            break
        if first is None:
            time.sleep(0.1)
    if first is not None:
        who, _, what = first.partition(": ")
        return PeerFailed(f"stopped because {who} failed first: {what.splitlines()[0] if what else ''}", first,
                          who.endswith(f"(node {_node()})"))
    return PeerFailed(f"stopped: a peer rank ended without reporting an error (killed, or its node lost); this "
                      f"rank's collective said: {str(e).splitlines()[0] if str(e) else type(e).__name__}", None, False)
