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

The same steps are public for writers whose temporary directory is shared by several processes
(the sharded training checkpoints of :mod:`fmoe.checkpoint.training`): :func:`begin` (one
process makes the temporary directory), :func:`commit` (fsync, modes, the swap) and
:func:`abort` (remove it). Nothing follows a symbolic link: a ``path`` that is a link is
refused naming it (the swap would replace the link, and removing the old copy would follow it).

Writes never destroy what they did not create: :func:`check_target` refuses a non-empty
``path`` holding files that are not checkpoint files (``config.json``, ``*.safetensors``, the
index, ...). With ``overwrite=True`` such a directory is kept and :func:`replace_files` swaps
in only the checkpoint files (each file atomically; stale shards of the previous checkpoint are
removed, everything else stays). Written files and directories get the usual modes
(``0666``/``0777`` minus the umask), not the private mode of a temporary directory.

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
import os
import re
import shutil
import tempfile
from typing import Callable, Iterator, Union

from . import fs

__all__ = ["atomic_directory", "begin", "commit", "abort", "remove_stale", "replace_files", "check_target",
           "checkpoint_file", "foreign_files", "TEMP_MARK"]

TEMP_MARK = ".tmp-"   # ``.<name>.tmp-<pid>-<random>``: the temporary directory of ``<name>``

_CKPT_FILE = re.compile(r"^(config\.json|generation_config\.json|model\.safetensors|"
                        r"model-\d+-of-\d+\.safetensors|model\.safetensors\.index\.json|fmoe\.json|"
                        r"tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json)$")


def checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file a Hugging Face checkpoint written by fmoe consists of."""
    return bool(_CKPT_FILE.match(name))


def remove_stale(path: Union[str, os.PathLike]) -> list[str]:
    """Remove the temporary directories of ``path`` left by processes that are gone.

    Args:
        path: the final directory whose ``.<name>.tmp-<pid>-*`` leftovers to remove.
    Returns:
        the removed names (sorted).
    """
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    prefix, gone = f".{name}{TEMP_MARK}", []
    if not os.path.isdir(parent):
        return gone
    for entry in sorted(os.listdir(parent)):
        if not entry.startswith(prefix):
            continue
        pid = entry[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not fs.pid_alive(int(pid)):
            fs.remove(os.path.join(parent, entry))
            gone.append(entry)
    return gone


def check_target(path: Union[str, os.PathLike], overwrite: bool = False, what: str = "save",
                 own: Callable[[str], bool] = checkpoint_file) -> str:
    """The absolute ``path`` after checking a checkpoint may be written there.

    Args:
        path: the checkpoint directory to write.
        overwrite: allow a directory that also holds other files (only checkpoint files are
            then replaced, see :func:`replace_files`).
        what: how to name the caller in errors.
        own: which file names the writer owns (may replace); default: Hugging Face checkpoint files.
    Returns:
        the absolute path.
    Raises:
        ValueError: ``path`` is a file, or a directory holding files that are not checkpoint
        files (named in the message) while ``overwrite`` is False.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{what}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if os.path.islink(path):
        raise ValueError(f"{what}: {path!r} is a symbolic link (to {os.readlink(path)!r}); fmoe never writes "
                         "through a link: remove it or pass the real directory")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{what}: path {path!r} exists and is not a directory; pass a directory path")
    others = foreign_files(path, own)
    if others and not overwrite:
        raise ValueError(
            f"{what}: {path!r} is not empty and is not a checkpoint directory: it holds "
            f"{others[:8]}{' ...' if len(others) > 8 else ''}, which writing a checkpoint there would "
            "delete. Choose a new or empty directory, or pass overwrite=True (--overwrite) to replace "
            "only the checkpoint files (config.json, *.safetensors, the index) and keep the rest")
    return path


def foreign_files(path: str, own: Callable[[str], bool] = checkpoint_file) -> list[str]:
    """Entries of directory ``path`` that are not checkpoint files (sorted; [] if none/absent)."""
    if not os.path.isdir(path):
        return []
    return sorted(n for n in os.listdir(path) if not own(n))


@contextlib.contextmanager
def replace_files(path: Union[str, os.PathLike]) -> Iterator[str]:
    """Write a checkpoint into an existing directory that also holds other files.

    Yields a temporary directory inside ``path``; on success each new file is renamed into
    ``path`` (atomically per file), then checkpoint files of the previous checkpoint that the new
    one does not have (stale shards) are removed. Files that are not checkpoint files are never
    touched. On an exception the temporary directory is removed and ``path`` is unchanged.
    """
    path = os.path.abspath(os.fspath(path))
    tmp = tempfile.mkdtemp(prefix=f".fmoe-write-{os.getpid()}-", dir=path)
    try:
        yield tmp
        fs.publish_modes(tmp)
        fs.fsync_tree(tmp)
        new = set(os.listdir(tmp))
        for name in sorted(new):
            os.replace(os.path.join(tmp, name), os.path.join(path, name))
        for name in os.listdir(path):
            if checkpoint_file(name) and name not in new and os.path.isfile(os.path.join(path, name)):
                os.remove(os.path.join(path, name))
        fs.fsync_dir(path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def begin(path: Union[str, os.PathLike], own: Callable[[str], bool] = checkpoint_file) -> str:
    """Start writing directory ``path``: the new empty temporary directory beside it.

    Args:
        path: the final directory (checked by :func:`check_target`; may exist).
        own: the file names a previous directory at ``path`` may hold (it is replaced whole).
    Returns:
        the temporary directory (``.<name>.tmp-<pid>-<random>``, same filesystem as ``path``).
    """
    path = check_target(path, own=own)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    remove_stale(path)
    return tempfile.mkdtemp(prefix=f".{name}{TEMP_MARK}{os.getpid()}-", dir=parent)


def commit(tmp: str, path: Union[str, os.PathLike], own: Callable[[str], bool] = checkpoint_file) -> None:
    """Publish ``tmp`` (from :func:`begin`) as ``path``: fsync, usual modes, one atomic swap.

    Args:
        tmp: the written temporary directory.
        path: the final directory; a previous one there is replaced and removed.
        own: as for :func:`begin`.
    Raises:
        ValueError: ``path`` became a symbolic link meanwhile (nothing is replaced).
    """
    path = check_target(path, own=own)
    parent = os.path.dirname(path)
    fs.publish_modes(tmp)
    fs.fsync_tree(tmp)
    if not os.path.lexists(path):
        os.rename(tmp, path)
    elif fs.exchange(tmp, path):
        if os.path.islink(tmp):             # a link slipped in after the check: put it back
            fs.exchange(tmp, path)
            raise ValueError(f"commit: {path!r} became a symbolic link; nothing was replaced")
        shutil.rmtree(tmp)                  # tmp now holds the previous directory
    else:
        old = tmp + ".old"
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
        fs.remove(old)
    fs.fsync_dir(parent)


def abort(tmp: str) -> None:
    """Remove a temporary directory from :func:`begin` (a failed or interrupted write)."""
    fs.remove(tmp)


@contextlib.contextmanager
def atomic_directory(path: Union[str, os.PathLike]) -> Iterator[str]:
    """Write a directory at ``path`` atomically (see the module docstring).

    Args:
        path: the final directory (it may exist: it is replaced only on success).
    Returns:
        a context manager yielding the temporary directory to write into.

    Example:
        >>> import shutil, tempfile
        >>> root = tempfile.mkdtemp()
        >>> path = os.path.join(root, "ckpt")
        >>> with atomic_directory(path) as tmp:
        ...     _ = open(os.path.join(tmp, "config.json"), "w").write("{}")
        ...     print(os.path.exists(path))              # nothing at path until the block ends
        False
        >>> os.listdir(path)
        ['config.json']
        >>> shutil.rmtree(root)
    """
    tmp = begin(path)
    try:
        yield tmp
        commit(tmp, path)
    except BaseException:
        abort(tmp)
        raise
