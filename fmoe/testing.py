"""Run a function on N local gloo ranks: the harness for tests, notebooks and benchmarks.

``spawn(fn, world_size, *args)`` starts ``world_size`` fresh processes (``spawn`` start method),
joins them into one gloo process group, calls ``fn(rank, world_size, *args)`` on each and
returns the per-rank results in rank order.

Nothing listens on the network: the ranks meet through a ``FileStore`` in a private temporary
directory (mode 0700, removed afterwards) instead of a TCP store, and gloo's own connections use
the loopback interface. Ranks never outlive the caller: each asks the kernel to kill it when its
parent dies (``PR_SET_PDEATHSIG`` on Linux) and a watchdog thread exits it when it is
re-parented (elsewhere). Ctrl-C goes to the caller, which then stops the ranks. Queues, pipes
and process handles are closed when ``spawn`` returns or raises, not at garbage collection.
Deprecation and future warnings print once (rank 0), not once per rank.

It never hangs and never hides a failure:

- the first rank that raises ends the run: every other rank is killed and the original
  exception is re-raised in the caller, with the rank and the remote traceback attached;
- a rank that dies without reporting (killed, segfault, ``os._exit``) ends the run the same way;
- after ``timeout`` seconds all ranks are killed and ``TimeoutError`` names the ranks still busy.

Functions and arguments travel with cloudpickle, so functions defined in a notebook or inside
a test work. Each rank uses ``threads`` intra-op threads (default: the machine's cores shared
out between the ranks) and gloo collectives time out after ``timeout`` seconds.

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

import ctypes
import datetime
import multiprocessing as mp
import os
import queue as _queue
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings
from typing import Any, Callable, Optional

import cloudpickle

__all__ = ["spawn", "RemoteTraceback", "free_port"]


class RemoteTraceback(Exception):
    """The traceback of an exception raised on a spawned rank (chained as ``__cause__``)."""


def free_port() -> int:
    """A currently free localhost TCP port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Exit this rank as soon as the process that spawned it is gone (SIGTERM, SIGKILL, crash)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (AttributeError, OSError):
            pass

    def watch() -> None:                 # also covers the race before prctl and other systems
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="fmoe-parent-watchdog", daemon=True).start()


def _loopback_interface() -> Optional[str]:
    for name in ("lo", "lo0"):
        if os.path.exists(f"/sys/class/net/{name}") or (name == "lo0" and sys.platform == "darwin"):
            return name
    return None


def _worker(payload: bytes, rank: int, world: int, store_dir: str, threads: int, timeout: float, q,
            parent: int) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the caller's to handle
    if rank:                                              # same code on every rank: warn once
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads))
    lo = _loopback_interface()
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo            # local ranks: never an outside interface
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(threads)
        fn, args = cloudpickle.loads(payload)
        store = dist.FileStore(os.path.join(store_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout))
        result = fn(rank, world, *args)
        q.put(("ok", rank, cloudpickle.dumps(result)))
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit
        tb = traceback.format_exc()
        try:
            blob = cloudpickle.dumps(e)
        except Exception:  # noqa: BLE001
            blob = None
        q.put(("err", rank, (blob, f"{type(e).__name__}: {e}", tb)))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          threads: Optional[int] = None, collective_timeout: Optional[float] = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results.

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
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"spawn: world_size must be an int >= 1, got {world_size!r}")
    if not callable(fn):
        raise TypeError(f"spawn: fn must be callable, got {type(fn).__name__}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"spawn: timeout must be a positive number of seconds, got {timeout!r}")
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    payload = cloudpickle.dumps((fn, args))
    ctx = mp.get_context("spawn")
    store_dir = tempfile.mkdtemp(prefix="fmoe-spawn-")      # mode 0700: this user only
    q = ctx.Queue()
    coll = float(collective_timeout or timeout)
    procs = [ctx.Process(target=_worker, args=(payload, r, world_size, store_dir, threads, coll, q,
                                               os.getpid()), daemon=True) for r in range(world_size)]
    results: dict[int, Any] = {}
    error: Optional[BaseException] = None
    deadline = time.monotonic() + timeout
    try:
        _start_without_main(procs)
        while len(results) < world_size:
            try:
                kind, rank, body = q.get(timeout=0.2)
            except _queue.Empty:
                if _dead(procs, results):
                    error = _fail(q, procs, results, first=None)
                    break
                if time.monotonic() > deadline:
                    busy = [r for r in range(world_size) if r not in results]
                    raise TimeoutError(f"spawn: ranks {busy} still running after {timeout} s; "
                                       "all ranks killed")
                continue
            if kind == "err":
                error = _fail(q, procs, results, first=(rank, body))
                break
            results[rank] = cloudpickle.loads(body)
    finally:
        _cleanup(procs, q, store_dir)
        procs = q = None        # type: ignore[assignment] # a raised traceback keeps this frame alive
    if error is not None:
        raise error             # raised here, not deeper: no frame holding the queue stays alive
    return [results[r] for r in range(world_size)]


def _cleanup(procs: list, q: Any, store_dir: str) -> None:
    """Kill what still runs and release every pipe, semaphore and process handle now."""
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:                             # started (start() may have failed)
            p.join(timeout=5)
    q.close()
    q.join_thread()
    for p in procs:
        if p.exitcode is not None:
            p.close()
    procs.clear()
    shutil.rmtree(store_dir, ignore_errors=True)


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


def _dead(procs, results) -> list[int]:
    return [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]


def _fail(q, procs, results, first) -> BaseException:
    """Pick the root cause among the failures seen within a short grace period.

    When one rank fails, its peers soon fail too, inside collectives ("connection reset").
    Those echoes are secondary: a rank's own exception wins, then a rank that died without
    reporting, then the first echo.
    """
    errors = [first] if first is not None else []
    end = time.monotonic() + 1.5
    while time.monotonic() < end and len(errors) + len(results) < len(procs):
        try:
            kind, rank, body = q.get(timeout=0.1)
        except _queue.Empty:
            continue
        if kind == "err":
            errors.append((rank, body))
    primary = [e for e in errors if not any(m in e[1][1] for m in _SECONDARY)]
    if primary:
        return _remote_error(*primary[0])
    reported = {r for r, _ in errors}
    dead = [r for r in _dead(procs, results) if r not in reported and procs[r].exitcode != 0]
    if dead:
        r = dead[0]
        return RuntimeError(f"spawn: rank {r} died with exit code {procs[r].exitcode} "
                            "before reporting a result")
    if errors:
        return _remote_error(*errors[0])
    r = _dead(procs, results)[0]
    return RuntimeError(f"spawn: rank {r} exited (code {procs[r].exitcode}) before reporting a result")


def _remote_error(rank: int, body) -> BaseException:
    blob, summary, tb = body
    exc = None
    if blob is not None:
        try:
            exc = cloudpickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, BaseException) or isinstance(exc, (KeyboardInterrupt, SystemExit)):
        exc = RuntimeError(f"rank {rank} failed: {summary}")
    note = f"raised on rank {rank} of fmoe.testing.spawn"
    if exc.args and isinstance(exc.args[0], str):
        exc.args = (f"[rank {rank}] {exc.args[0]}",) + tuple(exc.args[1:])
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    exc.rank = rank  # type: ignore[attr-defined]
    exc.__cause__ = RemoteTraceback(f"{note}:\n{tb}")
    return exc
