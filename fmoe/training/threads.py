"""``--threads N``: intra-op threads per rank of the main job, chosen, not left to torch.

Torch's default is one thread per physical core in *every* process, so ``--nproc 4`` on a
4-core machine runs 16 threads on 4 cores, and a one-process job on a machine other jobs share
competes with them for every core (issue 25: 3.5 s/step with the default threads vs 0.08 s
with one, on a busy 2-core machine). The default here splits the *idle* cores this process may run on evenly
over the local ranks (``--nproc``, or torchrun's ``LOCAL_WORLD_SIZE``), at least one each::

    threads = max(1, min(cores, cores - round(load)) // local_ranks)

with ``cores`` from ``os.sched_getaffinity`` (a container's or ``taskset``'s limit, not the
machine's count) and ``load`` the one-minute load average at start (``os.getloadavg``: work
other jobs already run; 0 on an idle machine, so there every core is used). Oversubscribing
a busy machine is far worse than leaving a core idle (the benchmark: 10x). ``--threads N``
overrides it.
Measured in ``benchmarks/RESULTS.md`` ("Intra-op threads of the main job").

Example:
    >>> default_threads(local_ranks=1, load=0.0) == usable_cores()
    True
    >>> default_threads(local_ranks=1, load=1e6)
    1
"""

from __future__ import annotations

import os
from typing import Any, Optional

__all__ = ["usable_cores", "default_threads", "local_ranks", "threads_of"]


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), else ``os.cpu_count()``."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_threads(local_ranks: int, load: Optional[float] = None) -> int:
    """The idle usable cores shared evenly by the ranks of this machine (module docstring).

    Args:
        local_ranks: ranks on this machine.
        load: runnable threads of other work (default: the one-minute load average).
    """
    cores = usable_cores()
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    idle = min(cores, cores - round(load))
    return max(1, idle // max(1, local_ranks))


def local_ranks(nproc: int) -> int:
    """Ranks on this machine: torchrun's ``LOCAL_WORLD_SIZE`` when launched by it, else ``nproc``."""
    if "LOCAL_WORLD_SIZE" in os.environ and "FMOE_SPAWNED" not in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return nproc


def threads_of(job: Any) -> int:
    """The job's threads per rank: ``--threads``, else :func:`default_threads` of its local ranks."""
    return job.threads if job.threads else default_threads(local_ranks(job.nproc))
