"""The run directory ``OUT``: one job at a time, and never another run's files.

A run owns what it writes into ``OUT``: ``log.jsonl``, ``step-N/`` checkpoints (and their
``.step-N.tmp`` while being written), ``tensorboard/`` and ``profile/`` (:mod:`fmoe.training.observe`)
and the lock file ``.lock``. Three rules follow:

- **one job per OUT**: the job holds ``OUT/.lock`` (an exclusive ``flock``; the file holds the
  owner's pid and host). A second job into the same OUT fails at once naming the owner. A lock
  left by a job that died is stale (the kernel dropped its ``flock``): it is taken over;
- **no mixing runs**: a new run refuses an OUT that holds another run's files unless it
  continues that run (``--resume`` of a checkpoint in OUT) or replaces it (``--overwrite``,
  which removes only those files: other files in OUT are kept). Resuming from an older
  checkpoint of OUT while newer ones exist is refused too; with ``--overwrite`` the newer
  checkpoints and their ``log.jsonl`` rows are removed first (:func:`drop_after`);
- **fail before training**: the lock is taken and OUT is written once (read-only, permissions)
  and checked for room for a checkpoint before the first step;
- **no links, no torn rows**: nothing in OUT is written through a symbolic link (a run file
  that is a link is refused naming it, :func:`links`; files are opened with ``O_NOFOLLOW``);
  a log row is one ``O_APPEND`` write, cut back if the write fails (:func:`append_row`); the
  temporaries of a killed save are removed by the next job (:func:`remove_temporaries`), and a
  resumed run's log keeps only the rows up to its checkpoint (:func:`trim_log`: a row torn by
  a crash is dropped and named, rows of steps that will be trained again are dropped too).

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
import tempfile
from typing import Optional

from ..checkpoint.steps import is_step_temporary, step_of

__all__ = ["OutLock", "RunDirBusy", "holds_run", "clear_run", "newer_steps", "drop_after", "check_room",
           "links", "remove_temporaries", "append_row", "trim_log"]

LOCK, LOG = ".lock", "log.jsonl"
TENSORBOARD, PROFILE = "tensorboard", "profile"       # --tensorboard, --profile-steps (fmoe.training.observe)
_LOG_TEMPORARY = re.compile(r"^\.log\.jsonl\..*\.tmp$")


def _run_file(name: str) -> bool:
    """A run's own file: the log, its TensorBoard and profiler directories, a checkpoint or an
    unfinished save (:mod:`fmoe.checkpoint.steps`)."""
    return name in (LOG, TENSORBOARD, PROFILE) or step_of(name) is not None or is_step_temporary(name)


def _temporary(name: str) -> bool:
    return is_step_temporary(name) or _LOG_TEMPORARY.match(name) is not None
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class RunDirBusy(RuntimeError):
    """Another live job holds the OUT directory."""


def holds_run(out: str) -> list[str]:
    """The names of a run's files in ``out`` (``log.jsonl``, ``step-N``), sorted; [] if none."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if _run_file(n))


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
    """The complete ``step-M`` checkpoints in ``out`` with ``M > step`` (temporaries of
    unfinished saves are not checkpoints: :func:`remove_temporaries` removes them)."""
    found = [(s, n) for n in holds_run(out) if (s := step_of(n)) is not None and s > step]
    return [n for _, n in sorted(found)]


def links(out: str) -> list[str]:
    """``OUT``'s entries that a job would write or remove and that are symbolic links (sorted):
    the run's files, ``.lock`` and the log's temporaries."""
    if not os.path.isdir(out):
        return []
    return sorted(n for n in os.listdir(out) if (_run_file(n) or _temporary(n) or n == LOCK)
                  and os.path.islink(os.path.join(out, n)))


def remove_temporaries(out: str) -> list[str]:
    """Remove what interrupted writes left in ``out`` (``.step-N.tmp*`` directories, log
    temporaries); call while holding ``OUT``'s lock (then nobody else writes there). Links are
    removed, never followed. Returns the removed names."""
    gone = sorted(n for n in os.listdir(out) if _temporary(n)) if os.path.isdir(out) else []
    for name in gone:
        _remove(os.path.join(out, name))
    return gone


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def drop_after(out: str, step: int) -> list[str]:
    """Forget what a run did after ``step``: remove newer checkpoints and ``log.jsonl`` rows
    (the log is rewritten atomically). Returns the removed checkpoint names."""
    gone = newer_steps(out, step)
    for name in gone:
        _remove(os.path.join(out, name))
    trim_log(out, step)
    return gone


def append_row(path: str, line: str) -> None:
    """Append one log row: a single ``O_APPEND`` write that never follows a link; a failed or
    short write (a full disk) is cut back, so the file never ends in a torn row.

    Raises:
        OSError: naming ``path`` (``ELOOP`` when it is a symbolic link).
    """
    data = (line + "\n").encode("utf-8")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"{os.strerror(e.errno)} opening {path}" +
                      (" (a symbolic link: fmoe never writes through one)" if os.path.islink(path) else "")) from e
    try:
        size = os.fstat(fd).st_size
        try:
            done = os.write(fd, data)
            if done != len(data):
                raise OSError(errno.ENOSPC, "short write")
        except OSError as e:
            try:
                os.ftruncate(fd, size)
            except OSError:
                pass
            raise OSError(e.errno, f"{e.strerror or e} writing {path}") from e
    finally:
        os.close(fd)


def trim_log(out: str, step: int) -> list[str]:
    """Keep the rows of ``OUT/log.jsonl`` up to ``step`` (rewritten atomically, never through a
    link); a torn or unreadable row is dropped. Returns one line per kind of dropped row (for
    the user; empty when nothing was dropped)."""
    log = os.path.join(out, LOG)
    if not os.path.isfile(log) or os.path.islink(log):
        return []
    with open(log, "rb") as f:
        lines = f.read().split(b"\n")
    keep, torn, later = [], [], []
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            at = row["step"] if isinstance(row, dict) else None
        except (ValueError, KeyError):
            at = None
        if isinstance(at, bool) or not isinstance(at, (int, float)):
            torn.append(i + 1)
        elif at <= step:
            keep.append(raw + b"\n")
        else:
            later.append(at)
    notes = []
    if torn:
        notes.append(f"{log}: dropped {len(torn)} unreadable row(s) (line(s) {torn[:5]}; torn by a crash or a "
                     "full disk)")
    if later:
        notes.append(f"{log}: dropped {len(later)} row(s) of steps after the checkpoint's step {step} "
                     f"(steps {int(min(later))}..{int(max(later))} are trained again)")
    if notes:
        fd, tmp = tempfile.mkstemp(prefix=".log.jsonl.", suffix=".tmp", dir=out)
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(keep)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, log)
        except BaseException:
            if os.path.lexists(tmp):
                os.remove(tmp)
            raise
    return notes


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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
        except OSError as e:
            if os.path.islink(self.path):
                raise OSError(e.errno, f"--out {self.out}: the lock {self.path} is a symbolic link (to "
                                       f"{os.readlink(self.path)!r}); fmoe never writes through a link: "
                                       "remove it") from e
            raise OSError(e.errno, f"cannot write --out {self.out}: {os.strerror(e.errno)}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown pid"
            os.close(fd)
            raise RunDirBusy(f"--out {self.out} is in use by another fmoe train job ({owner}; lock "
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
