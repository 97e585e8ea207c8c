"""One line for a failed checkpoint read or write: disk full, read-only or permission failures
name the target (``"no space left on device writing OUT/step-N"``), and torch's
``CheckpointException`` (a ``BaseException`` holding per-rank failures) becomes one error naming
the ranks and the first cause.

Example:
    >>> import errno
    >>> str(io_error(OSError(errno.EROFS, "Read-only file system"), "out/step-1"))
    '[Errno 30] cannot write out/step-1: Read-only file system'
"""

from __future__ import annotations

import errno
import os

import torch.distributed.checkpoint as dcp

__all__ = ["io_error"]


def io_error(e: BaseException, target: str) -> BaseException:
    """An exception that names ``target`` for disk-full / read-only / permission failures and
    for torch's ``CheckpointException`` (a ``BaseException`` holding per-rank failures)."""
    causes = [e]
    if isinstance(e, dcp.api.CheckpointException):
        causes = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    for c in causes:
        if isinstance(c, OSError) and c.errno == errno.ENOSPC:
            if str(c.strerror).startswith("no space left on device"):      # already says where
                return c
            return OSError(errno.ENOSPC, f"no space left on device {target}")
        if isinstance(c, OSError) and c.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            return OSError(c.errno, f"cannot write {target}: {os.strerror(c.errno)}")
    if isinstance(e, dcp.api.CheckpointException):
        ranks = sorted(e.failures)
        c = causes[0]
        return RuntimeError(f"{target} failed on rank(s) {ranks}: {type(c).__name__}: {c}")
    return e
