"""The caller side of a launch: the fork server every rank starts from (:func:`context`), a set
of started ranks and their results (:class:`Ranks`), and :func:`run`, the one-shot launch (see
:mod:`fmoe.launch`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import shutil
import socket
import sys
import tempfile
import time
import types
from typing import Any, Callable, Optional, Sequence

import cloudpickle

from .rank import _CallerStdio, _enter, _one_shot, default_threads

__all__ = ["run", "Ranks", "RemoteTraceback", "free_port", "check_world", "context"]


#: What the fork server imports once; the ranks it forks start with these imported.
PRELOAD = ["cloudpickle", "torch", "torch.distributed", "fmoe", "fmoe.launch", "fmoe.testing.pool", "fmoe.models"]


def context() -> Any:
    """The ``multiprocessing`` context every rank starts from: the fork server, preloaded with
    :data:`PRELOAD`, where the platform has one (Linux), else ``spawn``.

    The fork server is one process per caller, started by the caller's first launch; it is
    single-threaded when it forks (nothing it imports starts a thread), and it exits when the
    caller does, which ends its ranks (:func:`die_with_parent`).

    Example:
        >>> context().get_start_method() in ("forkserver", "spawn")
        True
    """
    if sys.platform.startswith("linux"):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)         # takes effect when the server starts
        return ctx
    return mp.get_context("spawn")


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a rank (chained as ``__cause__``)."""


def free_port() -> int:
    """A currently free localhost TCP port (for programs that need a TCP rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_world(world_size: Any, timeout: Any, who: str, fn: Any = print) -> None:
    """The argument checks every launcher runs before starting anything (``who`` names it)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"{who}: world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"{who}: fn must be callable, got {type(fn).__name__}")
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"{who}: timeout must be a positive number of seconds, got {timeout!r}")



class Ranks:
    """``world`` started processes, one result queue and a private store directory.

    ``target(*args_of(rank), q, parent_pid)`` runs in each process. ``wait`` collects one
    round of results; ``close`` kills what still runs and releases everything now.
    """

    def __init__(self, world: int, target: Callable[..., None], args_of: Callable[[int, str], tuple],
                 who: str):
        self.world, self.who = world, who
        self.retiring: dict[int, str] = {}      # rank -> why it must be replaced (a "retire" message)
        self.ctx = context()
        self.dir = tempfile.mkdtemp(prefix="fmoe-ranks-")      # mode 0700: this user only
        self.q = self.ctx.Queue()
        env = dict(os.environ)                                 # the fork server's may be older
        lifeline, self.lifeline = self.ctx.Pipe(duplex=False)  # only this process holds the writer
        self.procs = [self.ctx.Process(target=_enter, args=(env, _CallerStdio(), lifeline, target, *args_of(r, self.dir),
                                                            self.q, os.getpid()), daemon=True) for r in range(world)]
        try:
            _start_without_main(self.procs)
        except BaseException:
            self.close()
            raise
        finally:
            lifeline.close()                                   # each rank has its own copy

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def dead(self, ranks: Sequence[int], done: Any = ()) -> list[int]:
        """Ranks among ``ranks`` (not in ``done``) whose process has exited."""
        return [r for r in ranks if r not in done and self.procs[r].exitcode is not None]

    def wait(self, ranks: Sequence[int], call: int, timeout: float, grace: float = 1.5
             ) -> tuple[dict[int, Any], Optional[BaseException], bool]:
        """Collect call ``call``'s results from ``ranks``.

        Returns:
            ``(results, error, settled)``: the results by rank; the root-cause error (or None);
            whether every rank reported and still lives (False: the processes must be replaced).
        Raises:
            TimeoutError: ranks still busy after ``timeout`` seconds (they are left running:
            the caller kills them).
        """
        results: dict[int, Any] = {}
        errors: list = []
        deadline = time.monotonic() + timeout
        while len(results) < len(ranks):
            try:
                c, kind, rank, body = self.q.get(timeout=0.2)
            except _queue.Empty:
                if self.dead(ranks, results):
                    break
                if time.monotonic() > deadline:
                    busy = [r for r in ranks if r not in results]
                    raise TimeoutError(f"{self.who}: ranks {busy} still running after {timeout} s; "
                                       "all ranks killed") from None
                continue
            if c != call:
                continue                                      # a late echo of an earlier call
            if kind == "retire":
                self.retiring[rank] = body
                continue
            if kind == "err":
                errors.append((rank, body))
                break
            results[rank] = cloudpickle.loads(body)
        if not errors and not self.dead(ranks, results):
            return results, None, True
        end = time.monotonic() + grace            # peers of a failed rank soon fail too: listen
        while time.monotonic() < end and len(errors) + len(results) < len(ranks):
            try:
                c, kind, rank, body = self.q.get(timeout=0.1)
            except _queue.Empty:
                continue
            if c == call and kind == "retire":
                self.retiring[rank] = body
            elif c == call and kind == "err":
                errors.append((rank, body))
            elif c == call:
                results[rank] = cloudpickle.loads(body)
        reported = {r for r, _ in errors} | set(results)
        settled = len(reported) == len(ranks) and not self.dead(ranks)
        return results, self._root_cause(ranks, results, errors, reported), settled

    def _root_cause(self, ranks, results, errors, reported) -> BaseException:
        """A rank's own exception wins, then a rank that died without reporting, then the first
        echo ("connection reset" in a collective: the peers of the failed rank)."""
        primary = [e for e in errors if not any(m in e[1][1] for m in _SECONDARY)]
        if primary:
            return remote_error(*primary[0], who=self.who)
        dead = [r for r in self.dead(ranks, results) if r not in reported and self.procs[r].exitcode != 0]
        if dead:
            r = dead[0]
            return RuntimeError(f"{self.who}: rank {r} died with exit code {self.procs[r].exitcode} "
                                "before reporting a result")
        if errors:
            return remote_error(*errors[0], who=self.who)
        r = self.dead(ranks, results)[0]
        return RuntimeError(f"{self.who}: rank {r} exited (code {self.procs[r].exitcode}) "
                            "before reporting a result")

    def close(self, grace: float = 0.0) -> None:
        """Stop every process (after ``grace`` seconds to exit by itself) and release all."""
        end = time.monotonic() + grace
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in self.procs:
            if p.pid is not None:                             # started (start() may have failed)
                p.join(timeout=5)
        self.q.close()
        self.q.join_thread()
        self.lifeline.close()
        for p in self.procs:
            if p.exitcode is not None:
                p.close()
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
        threads: Optional[int] = None, collective_timeout: Optional[float] = None,
        who: str = "fmoe.launch.run") -> list[Any]:
    """Start ``world_size`` fresh gloo ranks, run ``fn(rank, world_size, *args)`` on each, stop them.

    Args:
        fn: function to run on each rank (any picklable or cloudpicklable callable).
        world_size: number of ranks (>= 1).
        *args: extra arguments passed to every rank.
        timeout: seconds before all ranks are killed.
        threads: intra-op threads per rank (default :func:`default_threads`).
        collective_timeout: gloo collective timeout in seconds (default: ``timeout``).
        who: the name error messages give the launcher (``"spawn"`` for ``fmoe.testing.spawn``).
    Returns:
        ``[result of rank 0, result of rank 1, ...]``.
    Raises:
        the first failing rank's exception (its rank and traceback attached), or
        ``RuntimeError`` for a rank that died, or ``TimeoutError``.
    """
    check_world(world_size, timeout, who, fn)
    threads = threads or default_threads(world_size)
    payload = cloudpickle.dumps((fn, args))
    coll = float(collective_timeout or timeout)
    ranks = Ranks(world_size, _one_shot, lambda r, d: (payload, r, world_size, os.path.join(d, "store"),
                                                       threads, coll), who)
    error: Optional[BaseException] = None
    try:
        results, error, _ = ranks.wait(range(world_size), 0, timeout)
    finally:
        ranks.close()
        ranks = None            # type: ignore[assignment] # a raised traceback keeps this frame alive
    if error is not None:
        raise error             # raised here, not deeper: no frame holding the queue stays alive
    return [results[r] for r in range(world_size)]


def _start_without_main(procs) -> None:
    """Start the ranks without re-importing the caller's ``__main__`` in each of them.

    ``fn`` travels by value (cloudpickle), so the ranks never need the caller's script; not
    importing it makes a script without an ``if __name__ == "__main__"`` guard work too (and
    start faster).
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        for p in procs:
            p.start()
    finally:
        if main is not None:
            sys.modules["__main__"] = main


_SECONDARY = ("Connection reset", "Connection closed", "connection closed", "pair.cc",
              "Timed out", "timed out", "Broken pipe", "Socket closed")


def remote_error(rank: int, body: tuple, who: str) -> BaseException:
    """The exception a rank reported, rebuilt in the caller: ``[rank r]`` in its message, ``.rank``
    set, and the rank's traceback chained as a :class:`RemoteTraceback`."""
    blob, summary, tb = body
    exc = None
    if blob is not None:
        try:
            exc = cloudpickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, BaseException) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        exc = RuntimeError(f"rank {rank} failed: {summary}")
    note = f"raised on rank {rank} of {who}"
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[rank {rank}] {exc.args[0]}",) + tuple(exc.args[1:])
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    exc.rank = rank  # type: ignore[attr-defined]
    exc.__cause__ = RemoteTraceback(f"{note}:\n{tb}")
    return exc
