"""The filesystem steps of an atomic save (:mod:`fmoe.checkpoint.atomic`): an atomic exchange of
two paths (Linux ``renameat2``), fsync of a directory and its files, the modes a plain
``open`` / ``mkdir`` would give, whether a temporary's owner is alive, removal that never follows
a link.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil

__all__ = ["umask", "publish_modes", "exchange", "fsync_tree", "fsync_dir", "pid_alive", "remove"]


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def publish_modes(directory: str) -> None:
    """Give ``directory`` and its files the modes a plain ``open``/``mkdir`` would (umask)."""
    mask = umask()
    os.chmod(directory, 0o777 & ~mask)
    for name in os.listdir(directory):
        file = os.path.join(directory, name)
        if os.path.isfile(file) and not os.path.islink(file):
            os.chmod(file, 0o666 & ~mask)

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def exchange(a: str, b: str) -> bool:
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


def fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        file = os.path.join(directory, name)
        if os.path.isfile(file):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems do not fsync directories
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove(path: str) -> None:
    """Remove a file, a link (not what it points to) or a directory tree."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)
