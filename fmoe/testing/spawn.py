"""``spawn``: one function on N fresh local gloo ranks, for one-off runs in tests and notebooks.

Fresh processes every call, forked from the launcher's fork server, which imported torch and
fmoe once (the first call in a process pays that, ~2 s; later ones ~0.1 s for 4 ranks); for many
calls use the warm :class:`fmoe.testing.Pool`. The launching, loopback-only rendezvous, failure
reporting and cleanup are :func:`fmoe.launch.run`'s, the same launcher the command-line programs
use.

Example (in a user's pytest file)::

    def check(rank, world):
        import torch, torch.distributed as dist
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert fmoe.testing.spawn(check, 4) == [6.0] * 4
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fmoe import launch

__all__ = ["spawn"]


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          threads: Optional[int] = None, collective_timeout: Optional[float] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo ranks; return the results.

    Args:
        fn: function to run on each rank (any picklable or cloudpicklable callable).
        world_size: number of ranks (>= 1).
        *args: extra arguments passed to every rank.
        timeout: seconds before all ranks are killed.
        threads: intra-op threads per rank (default ``max(1, cpu_count // world_size)``).
        collective_timeout: gloo collective timeout in seconds (default: ``timeout``).
    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    Raises:
        the first failing rank's exception (its rank and traceback attached), or
        ``RuntimeError`` for a rank that died, or ``TimeoutError``.

    Example:
        >>> spawn(lambda rank, world: rank * world, 2)
        [0, 2]
    """
    return launch.run(fn, world_size, *args, timeout=timeout, threads=threads,
                      collective_timeout=collective_timeout, who="spawn")
