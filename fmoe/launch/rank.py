"""The rank side of a launch: what a started rank does before and after the caller's function.

A rank takes the caller's environment, stdout and stderr (``_CallerStdio``, ``_enter``), dies
with its caller (:func:`die_with_parent`, the lifeline pipe), pins its threads and loopback
interface (:func:`rank_setup`), joins the group over the private ``FileStore``
(:func:`join_group`, gloo pairs connect lazily), leaves it (:func:`leave_group`) and reports the
outcome of the call (:func:`outcome` / :func:`report`). The warm pool reuses these pieces.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import signal
import sys
import threading
import traceback
import warnings
from typing import Any, Callable, Optional, Sequence

import cloudpickle

__all__ = ["default_threads", "die_with_parent", "rank_setup", "join_group", "leave_group", "outcome", "report",
           "print_to"]


def default_threads(world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores shared out between the ranks."""
    return max(1, (os.cpu_count() or 1) // world_size)


_PR_SET_PDEATHSIG = 1


def die_with_parent(caller: int) -> None:
    """Exit this rank as soon as the process that launched it (``caller``) is gone.

    Two mechanisms, for the two ways a rank starts: the kernel kills a rank whose parent exits
    (``PR_SET_PDEATHSIG`` on Linux; the parent is the caller under ``spawn``), and every rank
    :class:`Ranks` starts also watches a pipe only the caller can write to (its "lifeline"): the
    pipe's end of file means the caller is gone, however it died, whoever the rank's parent is
    (under the fork server it is the server, which outlives the caller while any rank lives)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (AttributeError, OSError):
            pass
    try:
        os.kill(caller, 0)                   # gone before the signal was armed
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


def _exit_at_eof(lifeline: Any) -> None:
    """Block until the caller's end of ``lifeline`` is closed (nothing is ever sent), then exit."""
    from multiprocessing.connection import wait

    wait([lifeline])
    os._exit(1)


def _loopback_interface() -> Optional[str]:
    for name in ("lo", "lo0"):
        if os.path.exists(f"/sys/class/net/{name}") or (name == "lo0" and sys.platform == "darwin"):
            return name
    return None


def rank_setup(rank: int, parent: int, world: int) -> None:
    """What a rank does once when it starts: die with its parent, leave Ctrl-C to it, warn once,
    keep gloo on the loopback interface, and give Inductor's compile workers the rank's share of
    the cores (``TORCHINDUCTOR_COMPILE_THREADS``, unless set: by default each of ``world`` ranks
    would start a worker per core of the machine, each importing torch)."""
    die_with_parent(parent)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(default_threads(world)))
    inductor = sys.modules.get("torch._inductor.config")     # imported by the fork server: it
    if inductor is not None:                                 # read the server's environment
        inductor.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the caller's to handle
    if rank:                                              # same code on every rank: warn once
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
    lo = _loopback_interface()
    if lo is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = lo            # local ranks: never an outside interface


def join_group(rank: int, world: int, store_path: str, threads: int, timeout: float) -> None:
    """Set the rank's environment and threads, then join the gloo group through ``store_path``.

    The group connects its rank pairs lazily (``TORCH_GLOO_LAZY_INIT``: a pair's TCP connection is
    made by its first message), so a call pays only for the pairs its collectives use: a ring
    all-reduce on 4 ranks connects 4 of the 6 pairs, and joining and destroying a group, the
    per-call cost of :class:`fmoe.testing.Pool`, is about twice as fast (``benchmarks/RESULTS.md``)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      OMP_NUM_THREADS=str(threads), TORCH_GLOO_LAZY_INIT="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def leave_group() -> None:
    """Destroy the default group and every group built on it (never raises)."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


def outcome(call: int, rank: int, fn: Callable[..., Any], args: Sequence[Any]) -> tuple:
    """Run ``fn(*args)``; return the message ``(call, "ok"|"err", rank, body)`` for the caller."""
    try:
        result = fn(*args)
        return (call, "ok", rank, cloudpickle.dumps(result))
    except BaseException as e:  # noqa: BLE001 - report everything, including SystemExit
        tb = traceback.format_exc()
        try:
            blob = cloudpickle.dumps(e)
        except Exception:  # noqa: BLE001
            blob = None
        return (call, "err", rank, (blob, f"{type(e).__name__}: {e}", tb))


def report(q: Any, call: int, rank: int, fn: Callable[..., Any], args: Sequence[Any]) -> None:
    """Run ``fn(*args)`` and put its :func:`outcome` on ``q``."""
    q.put(outcome(call, rank, fn, args))


def _one_shot(payload: bytes, rank: int, world: int, store_path: str, threads: int, timeout: float,
              q: Any, parent: int) -> None:
    rank_setup(rank, parent, world)
    try:
        def body():
            fn, args = cloudpickle.loads(payload)
            join_group(rank, world, store_path, threads, timeout)
            return fn(rank, world, *args)

        report(q, 0, rank, body, ())
    finally:
        leave_group()


class _CallerStdio:
    """The caller's stdout and stderr as they are at the launch, sent to the rank as file
    descriptors (a fork server's ranks would otherwise inherit the server's, which are the
    caller's from the moment the server started: under pytest, an earlier test's capture file)."""

    def __init__(self, fds: tuple = ()) -> None:
        self.fds = fds

    def __reduce__(self) -> tuple:                 # pickled while the rank starts: the fds go along
        from multiprocessing import reduction

        return (_CallerStdio._rebuild, (reduction.DupFd(1), reduction.DupFd(2)))

    @staticmethod
    def _rebuild(out: Any, err: Any) -> "_CallerStdio":
        return _CallerStdio((out.detach(), err.detach()))

    def take(self) -> None:
        """Make them this process's fds 1 and 2."""
        print_to(self.fds)
        for fd in self.fds:
            if fd not in (1, 2):
                os.close(fd)


def print_to(fds: tuple) -> None:
    """Make ``fds`` (stdout, stderr) this process's fds 1 and 2, after flushing what was written."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            stream.flush()
    for fd, target in zip(fds, (1, 2)):
        if fd != target:
            os.dup2(fd, target)


def _enter(env: dict, stdio: _CallerStdio, lifeline: Any, target: Callable[..., None], *args: Any) -> None:
    """A started rank: take the caller's environment, stdout and stderr as they were at the launch,
    exit when the caller's end of ``lifeline`` closes (:func:`die_with_parent`), then run ``target``."""
    os.environ.clear()
    os.environ.update(env)
    stdio.take()
    threading.Thread(target=_exit_at_eof, args=(lifeline,), name="fmoe-caller-lifeline", daemon=True).start()
    target(*args)
