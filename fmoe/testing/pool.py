"""A warm rank pool: N gloo ranks kept alive that run many functions, each call on a clean slate.

``fmoe.testing.spawn`` pays for fresh processes every time (forked from the launcher's fork
server, which imported torch and fmoe once: ~0.1 s for 4 ranks). A :class:`Pool` pays that
once; each :meth:`Pool.run` then costs a new process group and one round trip (~40 ms for 4
ranks). Each call is as if the ranks were fresh:

- a fresh default gloo group (a new ``FileStore`` file in the pool's private directory), destroyed
  after the call with every sub-group built on it (a ``fmoe.Mesh``'s groups included);
- the caller's stdout and stderr of the call (its fds 1 and 2, sent along with the call): under
  pytest, what the ranks print lands in the capture of the test that makes the call;
- process state restored after the call: environment variables, working directory,
  ``sys.path``, warning filters, torch's default dtype, grad mode, deterministic-algorithms flag,
  the random generators (torch, ``random``, numpy) reset to the pool's start state, ``fmoe.ep``
  registrations, ``torch._dynamo`` caches, DTensor's sharding and redistribute caches (they hold
  the call's meshes); the call's tensors are collected before the next call.
  Module-level state of imported modules (yours included) lives as long as the rank does.

The guarantees are :mod:`fmoe.launch`'s: the first failing rank's exception is re-raised with its
rank and traceback; a rank that dies, or a call past its ``timeout``, ends the call and the pool
replaces its processes before the next call; loopback and ``FileStore`` only; no process outlives
the pool (``close``, the ``with`` block, garbage collection, interpreter exit, or the caller's
death). A pool of N ranks runs functions on any ``world <= N`` (ranks ``0..world-1``).

Example:
    >>> def total(rank, world, scale):
    ...     import torch, torch.distributed as dist
    ...     t = torch.tensor([float(rank)])
    ...     dist.all_reduce(t)
    ...     return t.item() * scale
    >>> with Pool(2) as pool:
    ...     pool.run(total, 2.0), pool.run(total, 1.0, world=1)
    ([2.0, 2.0], [0.0])
"""

from __future__ import annotations

import gc
import itertools
import os
import sys
import warnings
import weakref
from typing import Any, Callable, Optional

import cloudpickle

from fmoe import launch

from .rank_state import RankState, gloo_workers

__all__ = ["Pool"]

_READY = -1          # the call id of the "imports done" message


class Pool:
    """``world_size`` warm gloo ranks on this machine (see the module docstring).

    Args:
        world_size: number of ranks kept alive (>= 1).
        start_timeout: seconds each (re)start may take (imports under load can be slow).
    """

    def __init__(self, world_size: int, start_timeout: float = 300.0):
        launch.check_world(world_size, start_timeout, "Pool")
        self.size, self.start_timeout = world_size, float(start_timeout)
        self._ranks: Optional[launch.Ranks] = None
        self._tasks: list = []
        self._stdio: list = []        # per rank: the socket that carries the caller's stdout / stderr
        self._ids = itertools.count()
        self._closed = False
        self._finalizer: Any = None
        self.starts = 0          # how many times processes were started (1 + rebuilds)
        self._start()

    # ------------------------------------------------------------------------------- lifecycle
    def _start(self) -> None:
        ctx = launch.context()
        tasks = [ctx.Queue() for _ in range(self.size)]
        stdio = [ctx.Pipe() for _ in range(self.size)]     # Unix socket pairs: they carry fds
        try:
            ranks = launch.Ranks(self.size, _serve, lambda r, d: (r, self.size, tasks[r], stdio[r][1]), "Pool.run")
        except BaseException:
            _close_queues(tasks)
            raise
        finally:
            for _, theirs in stdio:
                theirs.close()                              # each rank holds its own copy
        self._ranks, self._tasks, self._stdio = ranks, tasks, [ours for ours, _ in stdio]
        self._finalizer = weakref.finalize(self, _stop, ranks, tasks, self._stdio)
        self.starts += 1
        try:
            _, error, settled = ranks.wait(range(self.size), _READY, self.start_timeout)
        except BaseException:
            self._discard()
            raise
        if error is not None or not settled:
            self._discard()
            raise RuntimeError(f"Pool: the ranks failed to start: {error}") from error

    def _discard(self) -> None:
        """Kill the processes now; the next :meth:`run` starts fresh ones."""
        if self._finalizer is not None:
            self._finalizer.detach()
            _stop(self._ranks, self._tasks, self._stdio, graceful=False)
        self._ranks, self._tasks, self._stdio, self._finalizer = None, [], [], None

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks (empty after :meth:`close` or a failed call)."""
        return [] if self._ranks is None else self._ranks.pids

    def close(self) -> None:
        """Stop the ranks (they exit, or are killed after 5 s) and release every resource."""
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()             # runs _stop once
        self._ranks, self._tasks, self._finalizer = None, [], None

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------------------------ calls
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0, world: Optional[int] = None,
            threads: Optional[int] = None, collective_timeout: Optional[float] = None) -> list[Any]:
        """Run ``fn(rank, world, *args)`` on ranks ``0..world-1``; return the results in rank order.

        Args:
            fn: function to run on each rank (picklable or cloudpicklable).
            *args: extra arguments passed to every rank.
            timeout: seconds before the call ends (the pool's processes are then replaced).
            world: ranks taking part (default: the pool's size).
            threads: intra-op threads per rank (default: the cores shared out between ``world``).
            collective_timeout: gloo collective timeout in seconds (default ``timeout``).
        Returns:
            ``[result of rank 0, ..., result of rank world-1]``.
        Raises:
            the first failing rank's exception (``.rank`` and the remote traceback attached),
            ``RuntimeError`` for a rank that died, ``TimeoutError`` for a call past ``timeout``.
        """
        world = self.size if world is None else world
        launch.check_world(world, timeout, "Pool.run", fn)
        if world > self.size:
            raise ValueError(f"Pool.run: world must be <= the pool's {self.size} ranks, got {world}")
        if self._closed:
            raise RuntimeError("Pool.run: the pool is closed")
        if self._ranks is None:
            self._start()
        assert self._ranks is not None
        call = next(self._ids)
        payload = cloudpickle.dumps((fn, args))
        store = os.path.join(self._ranks.dir, f"store-{call}")
        task = (call, world, payload, store, threads or launch.default_threads(world),
                float(collective_timeout or timeout), list(sys.path))
        error: Optional[BaseException] = None
        try:
            for r in range(world):
                _send_stdio(self._stdio[r])
                self._tasks[r].put(task)
            results, error, settled = self._ranks.wait(range(world), call, timeout)
        except BaseException:              # a timeout, or Ctrl-C in the caller: ranks may be busy
            self._discard()
            raise
        finally:
            if os.path.exists(store):
                os.remove(store)
        if self._ranks.retiring:
            # a group that outlives its call keeps its gloo threads and sockets: a suite that
            # piled up hundreds of them per rank thrashed (RESULTS.md), so these ranks are replaced
            why = "; ".join(f"rank {r}: {w}" for r, w in sorted(self._ranks.retiring.items()))
            warnings.warn(f"Pool.run({getattr(fn, '__qualname__', fn)}): {why} (kept by module-level "
                          "state, e.g. a cached DeviceMesh); the pool's ranks are replaced", RuntimeWarning,
                          stacklevel=2)
            settled = False
        if not settled:
            self._discard()
        if error is not None:
            raise error
        return [results[r] for r in range(world)]


def _close_queues(tasks: list) -> None:
    for t in tasks:
        t.close()
        t.join_thread()


def _send_stdio(conn: Any) -> None:
    """Send this process's stdout and stderr (fds 1 and 2) to a rank: it prints there for the call
    (under pytest, into the capture of the test that makes the call)."""
    from multiprocessing import reduction

    try:
        reduction.send_handle(conn, 1, 0)
        reduction.send_handle(conn, 2, 0)
    except OSError:
        pass                   # a dead rank: the wait for the call's results reports it


def _stop(ranks: Optional[launch.Ranks], tasks: list, stdio: list = (), graceful: bool = True) -> None:
    for conn in stdio:
        conn.close()
    if ranks is None:
        return
    if graceful:
        for t in tasks:
            try:
                t.put(None)
            except (ValueError, OSError):
                pass
    ranks.close(grace=5.0 if graceful else 0.0)
    _close_queues(tasks)


# ----------------------------------------------------------------------------------- rank side
def _serve(rank: int, size: int, tasks: Any, stdio: Any, q: Any, parent: int) -> None:
    """A pool rank: import once, then run calls until told to stop, each printing to the stdout
    and stderr its caller sent along (``stdio``)."""
    from multiprocessing import reduction

    launch.rank_setup(rank, parent, size)    # torch and fmoe are imported (once per rank): this
    clean = RankState.capture()              # module's package imported them to unpickle _serve
    home = (os.dup(1), os.dup(2))            # stdout / stderr between calls
    gc.freeze()          # what the imports made is permanent: the per-call collection skips it
    q.put((_READY, "ok", rank, cloudpickle.dumps(None)))
    while True:
        task = tasks.get()
        if task is None:
            return
        call, world, payload, store, threads, coll, path = task
        call_fds = (reduction.recv_handle(stdio), reduction.recv_handle(stdio))
        launch.print_to(call_fds)
        sys.path[:0] = [p for p in path if p not in sys.path]     # test folders added since start

        def body():
            fn, args = cloudpickle.loads(payload)
            launch.join_group(rank, world, store, threads, coll)
            return fn(rank, world, *args)

        message = launch.outcome(call, rank, body, ())
        launch.leave_group()
        launch.print_to(home)                                 # the call's output is all out
        for fd in call_fds:
            os.close(fd)
        clean.restore()
        del body
        gc.collect()
        leaked = gloo_workers()          # threads of groups that outlived the call (module state)
        if leaked:
            q.put((call, "retire", rank, f"{leaked // 2} gloo group(s) outlived the call"))
        q.put(message)
