"""The one launcher core: local gloo ranks on loopback, their failures, their end.

Every place that starts ranks on this machine goes through here: ``fmoe train`` and
``fmoe generate`` (``run``), ``fmoe.testing.spawn`` (``run``) and the warm
``fmoe.testing.Pool`` (``Ranks`` and the rank-side helpers). The rules are the same for all:

- nothing listens on the network: ranks meet through a ``FileStore`` in a private temporary
  directory (mode 0700, removed afterwards) and gloo's own connections use the loopback
  interface (``GLOO_SOCKET_IFNAME``);
- ranks never outlive the caller: each exits when the caller's end of its "lifeline" pipe
  closes (the caller died, however) and asks the kernel to kill it when its parent dies
  (``PR_SET_PDEATHSIG`` on Linux);
  Ctrl-C goes to the caller, which then stops the ranks; queues, pipes and process handles are
  closed when the caller is done with them, not at garbage collection;
- a failure is never hidden: the first rank that raises is the one reported (its exception
  re-raised in the caller with the rank and the remote traceback attached), a rank that dies
  without reporting ends the wait the same way, and after ``timeout`` seconds the wait ends with
  a ``TimeoutError`` naming the ranks still busy.

Functions and arguments travel with cloudpickle, so functions defined in a notebook or inside a
test work. Deprecation and future warnings print once (rank 0), not once per rank.

Ranks start from a fork server (:func:`context`, Linux): one helper process per caller imports
torch and fmoe once and forks every rank from there, so a rank starts with them imported instead
of paying seconds of imports each (``benchmarks/RESULTS.md``). Each rank still gets the caller's
``sys.path``, working directory, environment, stdout and stderr as they are when it starts; only
what torch reads from the environment *while it is imported* (``TORCH_LOGS``, for example) comes
from the moment the fork server started, the caller's first launch.

Example:
    >>> def total(rank, world):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([float(rank)])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> run(total, 2)
    [1.0, 1.0]
"""

from .caller import PRELOAD, Ranks, RemoteTraceback, check_world, context, free_port, run
from .rank import default_threads, die_with_parent, join_group, leave_group, outcome, print_to, rank_setup, report

__all__ = ["run", "Ranks", "RemoteTraceback", "free_port", "check_world", "default_threads", "context", "print_to",
           "PRELOAD", "die_with_parent", "rank_setup", "join_group", "leave_group", "outcome", "report"]
