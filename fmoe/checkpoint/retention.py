"""Checkpoint retention: ``--keep-last N`` keeps a run's N newest complete checkpoints.

After each save the job calls :func:`prune` (on one process, holding ``OUT``'s lock): every
complete ``OUT/step-M`` older than the N newest is removed, except the checkpoints named in
``keep`` (the one the job resumed from: a failure before the next save must still find it).
Removing is atomic per checkpoint: the directory is first renamed to a hidden temporary name
(``.step-M.tmp-<pid>-<random>``, the name an unfinished save has), so a reader sees either the
whole checkpoint or none of it, :func:`fmoe.checkpoint.training.latest` never picks it, and what a
process killed while deleting leaves behind is removed by the next job that holds ``OUT``'s lock.
Only complete checkpoints (with ``meta.json``) count and only those are removed; links are never
followed or removed.

Example:
    >>> import os, tempfile
    >>> out = tempfile.mkdtemp()
    >>> for m in (1, 2, 3, 4):
    ...     os.makedirs(os.path.join(out, f"step-{m}"))
    ...     open(os.path.join(out, f"step-{m}", "meta.json"), "w").close()
    >>> prune(out, 2, keep=[os.path.join(out, "step-1")])
    ['step-2']
    >>> sorted(os.listdir(out))
    ['step-1', 'step-3', 'step-4']
"""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Iterable

from .atomic import TEMP_MARK
from .steps import step_of

__all__ = ["prune", "complete_steps"]


def complete_steps(out: str) -> list[tuple[int, str]]:
    """``(step, name)`` of every complete checkpoint directory in ``out`` (not a link), by step."""
    if not os.path.isdir(out):
        return []
    found = []
    for name in os.listdir(out):
        step, path = step_of(name), os.path.join(out, name)
        if step is not None and not os.path.islink(path) and os.path.isfile(os.path.join(path, "meta.json")):
            found.append((step, name))
    return sorted(found)


def prune(out: str, keep_last: int, keep: Iterable[str] = ()) -> list[str]:
    """Remove all but the ``keep_last`` newest complete checkpoints of run directory ``out``.

    Args:
        out: the run directory (call while holding its lock, on one process).
        keep_last: how many of the newest complete checkpoints stay (>= 1).
        keep: checkpoint paths never removed (the one the job resumed from).
    Returns:
        the removed checkpoint names, oldest first.
    Raises:
        ValueError: ``keep_last`` is not an integer >= 1.
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"--keep-last must be an integer >= 1, got {keep_last!r}")
    kept = {os.path.realpath(p) for p in keep}
    old = complete_steps(out)[:-keep_last]
    gone = []
    for _, name in old:
        path = os.path.join(out, name)
        if os.path.realpath(path) in kept:
            continue
        aside = os.path.join(out, f".{name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")
        os.rename(path, aside)                         # atomic: whole or gone
        shutil.rmtree(aside)
        gone.append(name)
    return gone
