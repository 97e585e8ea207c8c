"""Atomic directory writes: a checkpoint at ``path`` is either the old one or the new one.

``with atomic_directory(path) as tmp:`` hands out an empty hidden directory next to ``path``
(``.<name>.tmp-<pid>-<random>``, same filesystem, so a rename is atomic). Everything is written
there; only when the block ends without an error are the files fsynced and the directory moved
into place:

- ``path`` does not exist: one ``rename``;
- ``path`` is a directory: Linux ``renameat2(RENAME_EXCHANGE)`` swaps the two directories in one
  atomic step, then the old one (now at the temporary name) is removed. Where the exchange is not
  available the old directory is renamed aside first and the new one renamed in (the only moment
  without a checkpoint at ``path`` is between those two renames).

On an exception the temporary directory is removed and ``path`` is untouched. A process killed
mid-write leaves its hidden temporary directory behind (never anything at ``path``); the next
``atomic_directory`` for the same ``path`` removes such leftovers whose process is gone.

Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> with atomic_directory(os.path.join(root, "ckpt")) as tmp:
    ...     with open(os.path.join(tmp, "config.json"), "w") as f:
    ...         _ = f.write("{}")
    >>> os.listdir(root)
    ['ckpt']
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import tempfile
from typing import Iterator, Union

__all__ = ["atomic_directory", "check_target"]

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2); False where the call is unavailable."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2 exchange of {a!r} and {b!r} failed: {os.strerror(err)}")


def _fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        file = os.path.join(directory, name)
        if os.path.isfile(file):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(directory)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not fsync directories
        pass
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: str, prefix: str) -> None:
    for name in os.listdir(parent):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def check_target(path: Union[str, os.PathLike]) -> str:
    """The absolute ``path``, after checking it is free or a directory (``ValueError`` otherwise)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"save: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"save: path {path!r} exists and is not a directory; pass a directory path")
    return path


@contextlib.contextmanager
def atomic_directory(path: Union[str, os.PathLike]) -> Iterator[str]:
    """Write a directory at ``path`` atomically (see the module docstring).

    Args:
        path: the final directory (it may exist: it is replaced only on success).
    Returns:
        a context manager yielding the temporary directory to write into.

    Example:
        >>> # with atomic_directory("ckpt") as tmp: write_checkpoint(tmp, tensors, config)
    """
    path = check_target(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    prefix = f".{name}.tmp-"
    _remove_stale(parent, prefix)
    tmp = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        yield tmp
        _fsync_tree(tmp)
        if not os.path.exists(path):
            os.rename(tmp, path)
        elif _exchange(tmp, path):
            shutil.rmtree(tmp)          # tmp now holds the previous checkpoint
        else:
            old = tmp + ".old"
            os.rename(path, old)
            try:
                os.rename(tmp, path)
            except BaseException:
                os.rename(old, path)
                raise
            shutil.rmtree(old)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
