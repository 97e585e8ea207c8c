"""The first failing rank, named once, for ranks another launcher started (torchrun's nodes).

When one rank fails, its peers fail soon after in their next collective with gloo's echo of it
("Connection closed by peer"), which names no rank. :func:`annotate` sorts a rank's error into
the two: a rank's own error (primary) is recorded in the job's rendezvous store, first writer
wins (``compare_set``), as ``rank R (node N): message``; an echo (secondary) waits briefly for
that record and becomes a :class:`PeerFailed` naming the first failing rank and node, or saying
that a peer ended without reporting (killed, or its node lost). The program prints a
:class:`PeerFailed` once per node (local rank 0), and not at all on the node of the rank that
failed first (which prints its own error).

A node's printing rank can be stopped by torchrun (SIGTERM) before it prints: a sibling that
found the failure first exits, and torchrun then terminates the node's other ranks. So a rank
that does not print its node's line records it (:func:`leave_node_line`) before it exits, and
the printing rank, stopped by a signal, ends with that line (:func:`node_reason`, a
:class:`NodeStopped`) instead of "stopped by SIGTERM": the node says why it stopped, once,
whichever of its ranks saw it first.
"""

from __future__ import annotations

import os
import time
from typing import Optional

import torch.distributed as dist

from ..launch.caller import _SECONDARY

__all__ = ["PeerFailed", "NodeStopped", "annotate", "is_echo", "one_line", "printing_rank", "prints", "leave_node_line",
           "node_reason", "KEY"]

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


class NodeStopped(RuntimeError):
    """The printing rank of a node was stopped by a signal after a sibling rank of its node failed;
    its message is the sibling's error line (``Type: message``)."""


def _node_key() -> str:
    return f"fmoe/node_line/{_node()}"


def one_line(e: BaseException, text: Optional[str] = None) -> str:
    r"""The one line a program prints for ``e``: ``text`` (default ``Type: message``), its lines
    joined by `` | ``.

    Example:
        >>> one_line(ValueError("bad\nvalue"))
        'ValueError: bad | value'
    """
    if text is None:
        text = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def printing_rank() -> bool:
    """Whether this rank prints its node's lines (local rank 0; every rank of a one-node launch
    that sets no ``LOCAL_RANK``)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _once_a_node(e: BaseException) -> bool:
    """Errors that are the same on every rank (a :class:`PeerFailed`, a ``SettingsMismatch``):
    printed once a node, by its printing rank."""
    from .settings import SettingsMismatch

    return isinstance(e, (PeerFailed, SettingsMismatch))


def prints(e: BaseException) -> bool:
    """Whether this rank prints ``e``: not on the node of the first failing rank (which prints its
    own error: ``same_node``), and an error the same on every rank only on the printing rank."""
    return not getattr(e, "same_node", False) and (printing_rank() or not _once_a_node(e))


def leave_node_line(e: BaseException) -> None:
    """On a rank that does not print its node's line, record ``e`` as the node's reason to stop.

    Only the errors printed once a node (:class:`PeerFailed` not of this node, ``SettingsMismatch``)
    are recorded, first writer wins; a no-op on the printing rank or without a store.

    Args:
        e: the error this rank ends with.
    """
    store = _store()
    if store is None or printing_rank() or getattr(e, "same_node", False) or not _once_a_node(e):
        return
    try:
        store.compare_set(_node_key(), "", one_line(e))
    except Exception:  # noqa: BLE001 - the store may be gone with its node
        pass


def node_reason(e: BaseException) -> Optional[RuntimeError]:
    """The error the printing rank ends with when a signal stopped it after a sibling's failure.

    Args:
        e: what stopped this rank.
    Returns:
        None unless ``e`` is a signal's interruption (not an ``Exception``) on the printing rank;
        then a :class:`NodeStopped` carrying the line a sibling recorded, or, when the job's first
        failure is a sibling's of this node (which printed it), a :class:`PeerFailed` with
        ``same_node`` (printed by nobody); None when neither was recorded.
    """
    store = _store()
    if isinstance(e, Exception) or not printing_rank() or store is None:
        return None
    try:
        if store.check([_node_key()]):
            line = store.get(_node_key()).decode()
            if line:
                return NodeStopped(line)
        if store.check([KEY]):
            first = store.get(KEY).decode()
            who = first.partition(": ")[0]
            if first and who.endswith(f"(node {_node()})"):
                return PeerFailed(f"stopped because {who} failed first", first, True)
    except Exception:  # noqa: BLE001
        pass
    return None
