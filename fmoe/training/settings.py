"""One configuration everywhere: every rank's job settings compared before the first step.

Ranks started by different launchers (two ``torchrun`` nodes, say) each parse their own command
line. Nodes started with different settings would otherwise train silently wrong (a different
``--lr`` per node) or deadlock (a different ``--steps``: one node waits in a step the other never
takes). :func:`check_same` makes every rank exchange its settings once, at start-up (one
``all_gather`` of a small object over the world group), and raises on every rank when they
differ, naming each differing setting with the ranks that hold each value::

    job settings differ between ranks (each node must be started with the same settings):
    lr: rank 0-1 0.003, rank 2-3 0.03

The comparison is of :func:`digest`, a SHA-256 of the settings as canonical JSON (sorted keys);
it is also what ``meta.json`` records as ``settings_digest``. Settings that may differ between
nodes without changing the job (:data:`LOCAL`: the local rank count, threads, progress bar,
tracebacks) are left out.

Example:
    >>> differences([{"lr": 0.003, "steps": 10}] * 2 + [{"lr": 0.03, "steps": 10}] * 2)
    ['lr: rank 0-1 0.003, rank 2-3 0.03']
    >>> len(digest({"lr": 0.003}))
    64
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable, Mapping, Sequence

from ..collectives import all_gather_objects

__all__ = ["LOCAL", "SettingsMismatch", "of_job", "record", "digest", "differences", "check_same", "rank_ranges"]

#: settings that may differ between nodes: they do not change what is computed
LOCAL = frozenset({"nproc", "threads", "quiet", "debug", "step_config"})
#: what a resolved job carries beside its settings (the config as given, the checkpoint's record, the
#: resolved Model object: its name is the setting)
_NOT_SETTINGS = frozenset({"config", "explicit", "resume_meta", "declared"})


class SettingsMismatch(ValueError):
    """Ranks of one job were started with different settings (raised on every rank)."""


def _plain(value: Any) -> Any:
    """A set as a sorted list (its ``repr`` order changes with the process's hash seed), else ``repr``."""
    return sorted(value, key=repr) if isinstance(value, (set, frozenset)) else repr(value)


def _canonical(settings: Mapping[str, Any]) -> str:
    return json.dumps(dict(settings), sort_keys=True, default=_plain, allow_nan=True)


def of_job(job: Any) -> dict[str, Any]:
    """The settings every rank of a resolved job (:class:`fmoe.training.resolve.Job`) must share,
    as plain JSON values: each job setting's value in use (a ``--resume`` fills in the kept ones),
    the world size, the schedule's end and the resumed checkpoint; not :data:`LOCAL`. ``meta.json``
    records them as ``settings``.

    Args:
        job: the resolved job (attributes by setting name).
    Returns:
        setting name -> value, sorted by name.
    """
    every = {k: v for k, v in vars(job).items() if k not in LOCAL and k not in _NOT_SETTINGS}
    return json.loads(_canonical(every))


def record(job: Any) -> dict[str, Any]:
    """What ``meta.json`` records about how the job ran: ``settings`` (:func:`of_job`), their
    ``settings_digest``, the ``versions`` of torch, fmoe and Python, and this rank's intra-op
    ``threads`` and ``interop_threads``."""
    import platform

    import torch

    from .. import __version__

    shared = of_job(job)
    return {"settings": shared, "settings_digest": digest(shared), "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(),
            "versions": {"torch": torch.__version__, "fmoe": __version__, "python": platform.python_version()}}


def digest(settings: Mapping[str, Any]) -> str:
    """SHA-256 (hex) of ``settings`` as canonical JSON (sorted keys; non-JSON values by ``repr``).

    Args:
        settings: setting name -> value.
    Returns:
        64 hex digits, equal for equal settings whatever their order.
    """
    return hashlib.sha256(_canonical(settings).encode()).hexdigest()


def rank_ranges(ranks: Iterable[int]) -> str:
    """Ranks as runs: ``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    out: list[str] = []
    ordered = sorted(ranks)
    start = prev = ordered[0]
    for r in ordered[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ",".join(out)


def differences(per_rank: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per setting whose value is not the same on every rank.

    Args:
        per_rank: each rank's settings, in rank order (a missing name counts as ``<unset>``).
    Returns:
        ``"name: rank 0-1 v, rank 2-3 w"`` lines, sorted by setting name (empty when all agree).
    """
    names = sorted(set().union(*per_rank))
    lines = []
    for name in names:
        groups: dict[str, list[int]] = {}
        for rank, settings in enumerate(per_rank):
            text = json.dumps(settings[name], sort_keys=True, default=_plain) if name in settings else "<unset>"
            groups.setdefault(text, []).append(rank)
        if len(groups) > 1:
            parts = sorted(groups.items(), key=lambda kv: kv[1][0])
            lines.append(f"{name}: " + ", ".join(f"rank {rank_ranges(rs)} {text}" for text, rs in parts))
    return lines


def check_same(settings: Mapping[str, Any], local: Iterable[str] = LOCAL) -> str:
    """Compare this rank's job settings with every other rank's (call on every rank of the default
    group, before the first step); one process: nothing to compare.

    Args:
        settings: the job's settings on this rank (setting name -> JSON-able value).
        local: names left out of the comparison (default :data:`LOCAL`).
    Returns:
        :func:`digest` of the compared settings (the same on every rank).
    Raises:
        SettingsMismatch: on every rank, naming each differing setting and the ranks of each value.
    """
    skip = frozenset(local)
    shared = {k: v for k, v in settings.items() if k not in skip}
    own = digest(shared)
    every = all_gather_objects((own, shared))
    if all(d == own for d, _ in every):
        return own
    lines = differences([s for _, s in every])
    raise SettingsMismatch("job settings differ between ranks (each node must be started with the same "
                           "settings): " + "; ".join(lines))
