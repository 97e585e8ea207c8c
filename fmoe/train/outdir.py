"""The run directory ``OUT``: one job at a time, and never another run's files.

A run owns what it writes into ``OUT``: ``log.jsonl``, ``step-N/`` checkpoints (and their
``.step-N.tmp`` while being written) and the lock file ``.lock``. Three rules follow:

- **one job per OUT**: the job holds ``OUT/.lock`` (an exclusive ``flock``; the file holds the
  owner's pid and host). A second job into the same OUT fails at once naming the owner. A lock
  left by a job that died is stale (the kernel dropped its ``flock``): it is taken over;
- **no mixing runs**: a new run refuses an OUT that holds another run's files unless it
  continues that run (``--resume`` of a checkpoint in OUT) or replaces it (``--overwrite``,
  which removes only those files: other files in OUT are kept). Resuming from an older
  checkpoint of OUT while newer ones exist is refused too; with ``--overwrite`` the newer
  checkpoints and their ``log.jsonl`` rows are removed first (:func:`drop_after`);
- **fail before training**: the lock is taken and OUT is written once (read-only, permissions)
  and checked for room for a checkpoint before the first step.

Example:
    >>> import tempfile
    >>> out = tempfile.mkdtemp()
    >>> holds_run(out)
    []
    >>> with OutLock(out):
    ...     pass
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
from typing import Optional

__all__ = ["OutLock", "RunDirBusy", "holds_run", "clear_run", "newer_steps", "drop_after", "check_room"]

LOCK = ".lock"
_RUN_FILE = re.compile(r"^(log\.jsonl|step-\d+|\.step-\d+\.tmp)$")


class RunDirBusy(RuntimeError):
    """Another live job holds the OUT directory."""


def holds_run(out: str) -> list[str]:
    """The names of a run's files in ``out`` (``log.jsonl``, ``step-N``), sorted; [] if none."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if _RUN_FILE.match(n))


def clear_run(out: str) -> list[str]:
    """Remove a previous run's files from ``out`` (only those :func:`holds_run` names)."""
    gone = holds_run(out)
    for name in gone:
        path = os.path.join(out, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    return gone


def newer_steps(out: str, step: int) -> list[str]:
    """The ``step-M`` checkpoints (and partial ``.step-M.tmp``) in ``out`` with ``M > step``."""
    found = []
    for name in holds_run(out):
        m = re.match(r"^\.?step-(\d+)(\.tmp)?$", name)
        if m and int(m.group(1)) > step:
            found.append(name)
    return sorted(found, key=lambda n: int(re.sub(r"\D", "", n)))


def drop_after(out: str, step: int) -> list[str]:
    """Forget what a run did after ``step``: remove newer checkpoints and ``log.jsonl`` rows
    (the log is rewritten atomically). Returns the removed checkpoint names."""
    gone = newer_steps(out, step)
    for name in gone:
        shutil.rmtree(os.path.join(out, name))
    log = os.path.join(out, "log.jsonl")
    if os.path.isfile(log):
        with open(log, encoding="utf-8") as f:
            keep = [line for line in f if _row_step(line) <= step]
        with open(log + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(keep)
        os.replace(log + ".tmp", log)
    return gone


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError):
        return float("inf")                  # an unreadable row is dropped with the newer ones


def check_room(out: str, need: int) -> None:
    """``OSError(ENOSPC)`` naming ``out`` if its filesystem has less than ``need`` bytes free."""
    free = shutil.disk_usage(out).free
    if free < need:
        raise OSError(errno.ENOSPC, f"no space left on device for a checkpoint in {out}: "
                                    f"{free / 1e6:.1f} MB free, a checkpoint needs about {need / 1e6:.1f} MB")


class OutLock:
    """Exclusive lock on a run directory (``OUT/.lock``); a context manager.

    Args:
        out: the run directory (created if missing).
    Raises:
        RunDirBusy: another live job holds it.
        OSError: OUT cannot be created or written (read-only filesystem, permissions).
    """

    def __init__(self, out: str):
        self.out, self.path = out, os.path.join(out, LOCK)
        self.fd: Optional[int] = None
        self.stale: Optional[str] = None     # the previous owner's record when it was stale

    def acquire(self) -> "OutLock":
        try:
            os.makedirs(self.out, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OSError(e.errno, f"cannot write --out {self.out}: {os.strerror(e.errno)}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
            os.close(fd)
            raise RunDirBusy(f"--out {self.out} is in use by another fmoe.train job ({owner}; lock "
                             f"{self.path}); wait for it to finish or choose another --out") from None
        previous = os.pread(fd, 200, 0).decode(errors="replace").strip()
        self.stale = previous or None         # the kernel released that owner's flock: it is gone
        record = f"pid {os.getpid()} on {socket.gethostname()}".encode()
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise OSError(e.errno, f"cannot write --out {self.out}: {os.strerror(e.errno)}") from e
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            os.remove(self.path)
        except OSError:
            pass
        os.close(self.fd)                      # drops the flock
        self.fd = None

    def __enter__(self) -> "OutLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
